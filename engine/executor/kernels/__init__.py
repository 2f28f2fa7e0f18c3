"""C++ CPU kernels, compiled at run time once per machine and cached on disk.

Built for the instruction set torch itself runs with (`torch.backends.cpu.get_cpu_capability()`):
`-march=native` on an AVX-512 CPU, AVX2 code where torch runs AVX2 (an AVX2-only CPU, or
`ATEN_CPU_CAPABILITY=avx2`, which is how the AVX2 build is checked on an AVX-512 machine), and
portable x86-64 code otherwise (`ATEN_CPU_CAPABILITY=default`). The cache key holds the sources,
torch's version, the flags and the CPU's.

What a build needs: a C++ compiler (`c++`, or `$CXX`) and ninja (a Python dependency), both
used through `torch.utils.cpp_extension`. Where the build fails the engine keeps its pure-torch
paths (slower, and the quantized linears keep dense copies of their weights) and says so in its
start-up line, `/health` and the `prefixgate_cache_config` metric; `make kernels`
(`python -m engine.executor.kernels`) builds them and fails loudly instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",  # the longest to compile: first, so that it never starts last
        "quant_matmul_4_5_iq4.cpp",
        "quant_matmul_6_8.cpp",
        "quant_matmul.cpp",
        "layer_ops.cpp",
        "sampling_ops.cpp",
        "register_ops.cpp",
    )
)
# part of the cache key, not compiled alone
HEADERS = tuple(
    Path(__file__).with_name(name) for name in ("vec.h", "ops.h", "quant_matmul_kernel.h")
)
# -fopenmp: at::parallel_for is inline OpenMP; the extension then binds to the libgomp.so.1
# torch already loaded (same soname), so there is one thread pool.
# -ffp-contract=off: no a * b + c fused behind our back, differently in different places (see
# vec.h's fma8); a query's result must not depend on the code path that computed it.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
# torch's CPU capability -> the target: x86-64-v3 is AVX2 + FMA + F16C, what every AVX2 CPU has
MARCH = {"AVX512": "-march=native", "AVX2": "-march=x86-64-v3"}
TARGETS = {"AVX512": "avx512", "AVX2": "avx2"}  # anything else: "portable"


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """Whether the C++ kernels serve this process, for which target, and why not."""

    target: str  # "avx512", "avx2" or "portable": the instruction set compiled for
    is_built: bool
    error: str | None = None  # why they are not built (the compiler's own words)
    # the quantized linears' integer dot products, chosen at run time: "amx+avx512-vnni"
    # (AMX tiles for blocks of 16 rows where Linux grants them), "avx512-vnni", "avx2" or
    # "portable"; the same bits on every one
    dot_products: str = ""
    # bf16 attention's path: "amx-bf16" (AMX tiles, where the CPU has them and Linux grants
    # them) or "vector"; one path for every call on a machine, so the invariance holds
    attention: str = ""

    @property
    def label(self) -> str:
        """The target when built, else "off": the start-up line, /health and metrics."""
        return self.target if self.is_built else "off"

    def describe(self) -> str:
        if self.is_built:
            return (
                f"C++ kernels ({self.target}: {' '.join(compile_flags())}; integer dot "
                f"products on {self.dot_products}; bf16 attention on {self.attention})"
            )
        return f"no C++ kernels, torch paths ({self.error})"


NOT_BUILT = KernelBuild("portable", False, "--no-compile or not a CPU device")


def kernel_target() -> str:
    return TARGETS.get(torch.backends.cpu.get_cpu_capability(), "portable")


def compile_flags() -> list[str]:
    march = MARCH.get(torch.backends.cpu.get_cpu_capability())
    return [*CFLAGS, *([march] if march else [])]


def kernel_cache_key() -> str:
    return build_key([source.read_bytes() for source in (*SOURCES, *HEADERS)])


def build_key(sources: list[bytes]) -> str:
    """What a built library depends on: torch, the flags, this CPU's features and the sources'
    bytes. A build folder named by it never holds a stale library (`load_extension`)."""
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(" ".join(compile_flags()).encode())
    digest.update(_cpu_flags().encode())
    for source in sources:
        digest.update(source)
    return digest.hexdigest()[:16]


def load_cpu_kernels(cache_dir: Path) -> bool:
    """Register `torch.ops.prefixgate.*`, compiling on first use; True when they are there."""
    return build_cpu_kernels(cache_dir).is_built


@cache
def build_cpu_kernels(cache_dir: Path) -> KernelBuild:
    """Register `torch.ops.prefixgate.*`, compiling on first use (about a minute on 2 cores).

    A failed build is logged as a warning and reported, not raised: the engine then serves
    on its torch paths."""
    build_dir = cache_dir / "kernels" / kernel_cache_key()
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            logger.info("compiling the CPU kernels once into %s (about a minute)", build_dir)
        compile_and_load(cache_dir)
    except (OSError, RuntimeError, ImportError) as exc:
        build = KernelBuild(kernel_target(), False, _one_line(exc))
        logger.warning(
            "CPU kernels unavailable, serving on the torch paths (slower, dense weight "
            "copies): %s. A C++ compiler and ninja are needed; `make kernels` shows the "
            "whole error.",
            build.error,
        )
        return build
    dot_products = str(torch.ops.prefixgate.quant_matmul_path())
    attention = str(torch.ops.prefixgate.attention_path())
    logger.info(
        "CPU kernels ready (%s; integer dot products on %s; bf16 attention on %s) in %.1f s",
        " ".join(compile_flags()),
        dot_products,
        attention,
        time.perf_counter() - started,
    )
    return KernelBuild(kernel_target(), True, dot_products=dot_products, attention=attention)


def compile_and_load(cache_dir: Path, verbose: bool = False) -> None:
    """The build itself (torch.utils.cpp_extension: ninja, then the .so loaded); raises
    what the compiler or the loader raised. `verbose`: the compiler's output on stdout."""
    key = kernel_cache_key()
    load_extension(
        f"prefixgate_kernels_{key}", SOURCES, cache_dir / "kernels" / key, verbose=verbose
    )


def load_extension(
    name: str,
    sources: tuple[Path, ...],
    build_dir: Path,
    include_dirs: tuple[Path, ...] = (),
    verbose: bool = False,
) -> None:
    """`sources` compiled with this machine's flags into `build_dir` (ninja skips what is
    built) and loaded, registering their ops. Also how tools/bench_kernels.py builds another
    revision's kernels beside these.

    `build_dir` is named by everything the build depends on (`build_key`), so a
    library already in it is loaded as it is: torch's builder would import setuptools and run
    ninja only to find nothing to do, ~0.1 s of every start. One that does not load (a build
    cut short) is built again."""
    built = build_dir / f"{name}.so"
    if _loads(built):
        return
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _builder_lock(build_dir):
        if _loads(built, quiet=True):  # another process built it while this one waited
            return
        load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=[*compile_flags(), *(f"-I{d}" for d in include_dirs)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )


def _loads(built: Path, quiet: bool = False) -> bool:
    """`built` loaded and its ops registered; False where there is none or it does not load
    (a build cut short), which is then built again."""
    if not built.is_file():
        return False
    try:
        torch.ops.load_library(str(built))  # type: ignore[no-untyped-call]
        return True
    except OSError as exc:
        if not quiet:
            logger.warning("%s does not load (%s): building it again", built, _one_line(exc))
        return False


@contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """One builder per build folder, and never a wait on a dead one.

    torch's builder marks a build in progress with a `lock` file that its `finally` removes;
    a builder killed mid-way (Ctrl-C twice, `kill -9`, a test session ending) leaves the file,
    and every later build into the folder waits for it forever: a server start that hangs at
    "compiling the CPU kernels". An flock is released by the kernel when its holder dies, so
    under it torch's `lock` file can only be a dead builder's, and goes."""
    with (build_dir / "builder.flock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("%s was left by a build that did not finish: removed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the Python package puts its binary in the environment's
    bin folder, which is not on PATH when the environment is not activated
    (`.venv/bin/prefixgate serve`)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _one_line(exc: BaseException) -> str:
    """The build error's head and its first line that says what went wrong (torch's message
    repeats every compiler command line first)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0].split(": [")[0] if lines else ""
    cause = next(
        (line for line in lines[1:] if "error" in line.lower() or "not found" in line), None
    )
    return f"{type(exc).__name__}: " + "; ".join(part for part in (head, cause) if part)[:300]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
