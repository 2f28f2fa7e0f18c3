"""C++ CPU kernels, compiled at run time once per machine and cached on disk.

Built for the instruction set torch itself runs with (`torch.backends.cpu.get_cpu_capability()`):
`-march=native` on an AVX-512 CPU, AVX2 code where torch runs AVX2 (an AVX2-only CPU, or
`ATEN_CPU_CAPABILITY=avx2`, which is how the AVX2 path is tested on an AVX-512 machine). The
cache key holds the sources, torch's version, the flags and the CPU's. Where no compiler works
the engine keeps its pure-torch paths and says so in the log.
"""

from __future__ import annotations

import hashlib
import logging
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("paged_attention.cpp", "layer_ops.cpp", "quant_matmul.cpp")
)
HEADERS = (Path(__file__).with_name("vec.h"),)  # part of the cache key, not compiled alone
# -fopenmp: at::parallel_for is inline OpenMP; the extension then binds to the libgomp.so.1
# torch already loaded (same soname), so there is one thread pool.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
# torch's CPU capability -> the target: x86-64-v3 is AVX2 + FMA + F16C, what every AVX2 CPU has
MARCH = {"AVX512": "-march=native", "AVX2": "-march=x86-64-v3"}


def compile_flags() -> list[str]:
    march = MARCH.get(torch.backends.cpu.get_cpu_capability())
    return [*CFLAGS, *([march] if march else [])]


def kernel_cache_key() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(" ".join(compile_flags()).encode())
    digest.update(_cpu_flags().encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@cache
def load_cpu_kernels(cache_dir: Path) -> bool:
    """Register `torch.ops.prefixgate.*`, compiling on first use (~30 s on 2 cores).

    True when the kernels are there; False (logged) when they cannot be built."""
    from torch.utils.cpp_extension import load

    key = kernel_cache_key()
    build_dir = cache_dir / "kernels" / key
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            logger.info("compiling the CPU kernels once into %s (about 30 s)", build_dir)
        load(
            name=f"prefixgate_kernels_{key}",
            sources=[str(s) for s in SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU kernels unavailable, using the torch paths: %s", exc)
        return False
    logger.info(
        "CPU kernels ready (%s) in %.1f s", " ".join(compile_flags()), time.perf_counter() - started
    )
    return True


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
