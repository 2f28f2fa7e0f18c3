"""Giving freed heap memory back to the operating system."""

from __future__ import annotations

import contextlib
import ctypes


def return_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS. glibc keeps them mapped: after it frees
    a large block it raises its mmap threshold, so the next blocks of that size come from the
    heap and stay there once freed. Loading and quantizing free hundreds of MB that way (a
    server at 1.06 GB RSS with ~0.36 GB of it free heap; a first start's quantizing peak
    ~230 MB higher)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it trims by itself
        ctypes.CDLL("libc.so.6").malloc_trim(0)
