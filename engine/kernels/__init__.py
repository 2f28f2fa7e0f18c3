"""C++ CPU kernels, compiled at run time once per machine and cached on disk.

Built with `-march=native` for the CPU at hand (AVX-512 or AVX2 alike), so the cache key
holds the source, torch's version and the CPU's flags. Where no compiler works the engine
keeps its pure-torch paths and says so in the log.
"""

from __future__ import annotations

import hashlib
import logging
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "layer_ops.cpp"))
# -fopenmp: at::parallel_for is inline OpenMP; the extension then binds to the libgomp.so.1
# torch already loaded (same soname), so there is one thread pool.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")


def kernel_cache_key() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_cpu_flags().encode())
    for source in SOURCES:
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
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU kernels unavailable, using the torch paths: %s", exc)
        return False
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
    return True


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
