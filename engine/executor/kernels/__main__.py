"""`python -m engine.executor.kernels` (`make kernels`): build the C++ CPU kernels for this
machine into the cache dir now, and fail loudly, with the compiler's output, if they do not
build. The server itself never fails on a build: it falls back to its torch paths."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from engine.executor.kernels import build_cpu_kernels, compile_flags, kernel_cache_key


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from engine.core.config import default_cache_dir  # the server's own cache dir

    cache_dir: Path = default_cache_dir()
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"flags {' '.join(compile_flags())}, into {cache_dir / 'kernels' / kernel_cache_key()}"
    )
    build = build_cpu_kernels(cache_dir)
    if not build.is_built:
        print(f"the C++ kernels did not build: {build.error}", file=sys.stderr)
        _show_compiler_output(cache_dir)
        return 1
    print(f"ok: {build.describe()}")
    return 0


def _show_compiler_output(cache_dir: Path) -> None:
    """Rebuild verbosely so the compiler's own messages reach the terminal."""
    from torch.utils.cpp_extension import load

    from engine.executor.kernels import SOURCES

    key = kernel_cache_key()
    try:
        load(
            name=f"prefixgate_kernels_{key}",
            sources=[str(s) for s in SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(cache_dir / "kernels" / key),
            is_python_module=False,
            verbose=True,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        print(exc, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
