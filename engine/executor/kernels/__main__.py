"""`python -m engine.executor.kernels` (`make kernels`): build the C++ CPU kernels for this
machine into the cache dir now, and fail loudly, with the compiler's output, if they do not
build. The server itself never fails on a build: it falls back to its torch paths."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from engine.core.config import default_cache_dir
from engine.executor.kernels import (
    build_cpu_kernels,
    compile_and_load,
    compile_flags,
    kernel_cache_key,
)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
    """Build again, verbosely, so the compiler's own messages reach the terminal."""
    try:
        compile_and_load(cache_dir, verbose=True)
    except (OSError, RuntimeError, ImportError) as exc:
        print(exc, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
