"""Why does a TORCH_CHECK with a formatted message segfault on the device image? Three one-op
extensions, each run in its own process: a literal message, a formatted one with torch's
default flags, the formatted one with our kernels' flags, and a plain std::runtime_error."""
import subprocess, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
from engine.executor.kernels import compile_flags
print("torch", torch.__version__, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI, "our flags", compile_flags())
SRC = r'''
#include <torch/extension.h>
#include <stdexcept>
void literal(int64_t k) { TORCH_CHECK(k < 0, "a literal message"); }
void formatted(int64_t k) { TORCH_CHECK(k < 0, "got ", k); }
void plain(int64_t k) { throw std::runtime_error(std::string("got ") + std::to_string(k)); }
TORCH_LIBRARY(probe_NAME, m) { m.def("literal(int k) -> ()", literal); m.def("formatted(int k) -> ()", formatted); m.def("plain(int k) -> ()", plain); }
'''
CHILD = r'''
import sys, torch
from torch.utils.cpp_extension import load_inline
name, flags, fn = sys.argv[1], sys.argv[2].split(), sys.argv[3]
load_inline(name, cpp_sources=[open(sys.argv[4]).read()], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=sys.argv[5])
try:
    getattr(getattr(torch.ops, name), fn)(3)
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0][:80])
'''
import tempfile, os
for label, flags in (("default", ""), ("ours", " ".join(compile_flags()))):
    name = f"probe_{label}"
    d = tempfile.mkdtemp(); src = Path(d, "p.cpp"); src.write_text(SRC.replace("NAME", label))
    for fn in ("literal", "formatted", "plain"):
        r = subprocess.run([sys.executable, "-c", CHILD, name, flags or "-O2", fn, str(src), d], capture_output=True, text=True)
        print(f"{label:8s} {fn:10s} rc={r.returncode} {r.stdout.strip()[:100]} {r.stderr.strip().splitlines()[-1][:120] if r.returncode and r.stderr.strip() else ''}")
