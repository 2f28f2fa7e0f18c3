"""Process memory: giving freed heap memory back to the operating system, and weights
placed on huge pages."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
from pathlib import Path

import torch


def return_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS. glibc keeps them mapped: after it frees
    a large block it raises its mmap threshold, so the next blocks of that size come from the
    heap and stay there once freed. Loading and quantizing free hundreds of MB that way (a
    server at 1.06 GB RSS with ~0.36 GB of it free heap; a first start's quantizing peak
    ~230 MB higher)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it trims by itself
        ctypes.CDLL("libc.so.6").malloc_trim(0)


HUGE_PAGE = 2 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether an anonymous mapping can ask for transparent huge pages here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise")


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" where it
    has none (not Linux)."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return ""
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else ""


class HugePageArena:
    """Tensors in one anonymous mapping that asks the kernel for 2 MB pages (madvise
    MADV_HUGEPAGE, which Linux honours in its "madvise" and "always" modes).

    Why: a batch-1 decode step streams every weight once, and in 4 KB pages the 1B's 816 MB
    of weights are 200,000 pages whose TLB misses cost page walks all through the step. On a
    Zen 4 VM the same engine's step ran 3-8% faster with its weights in 2 MB pages
    (docs/benchmarks.md). torch's own switch (THP_MEM_ALLOC_ENABLE) advises each allocation
    of 2 MB and more alone, at 4 KB alignment, so a layer's smaller scale tensors and the
    edges of the others would stay in small pages; here they lie back to back.

    The cost is at start: this VM faulted 2 MB pages in at ~0.9 s a GB, 4 KB ones at ~0.2."""

    def __init__(self, num_bytes: int) -> None:
        self.size = num_bytes
        # whole 2 MB pages from a 2 MB boundary (the last one too: a page the mapping does not
        # wholly cover stays in 4 KB pages), and room to find that boundary; reserved, not
        # resident until written
        pages = -(-num_bytes // HUGE_PAGE)
        self._map = mmap.mmap(-1, (pages + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            # a kernel built without THP refuses the advice: the arena is then plain memory
            with contextlib.suppress(OSError):
                self._map.madvise(advice)
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the map alive
        self._start = -self._buffer.data_ptr() % HUGE_PAGE
        self._used = 0

    @staticmethod
    def span(num_bytes: int) -> int:
        """Bytes `empty` takes for `num_bytes` (every start 64-byte aligned)."""
        return -(-num_bytes // 64) * 64

    def empty(self, num_bytes: int) -> torch.Tensor:
        """`num_bytes` uninitialized bytes of the arena, as uint8."""
        span = self.span(num_bytes)
        if self._used + span > self.size:
            raise ValueError(f"the arena's {self.size} bytes are full")
        at = self._start + self._used
        self._used += span
        return self._buffer[at : at + num_bytes]

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in the arena."""
        out = self.empty(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
        return out.copy_(tensor)


def huge_page_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of 2 MB pages (AnonHugePages in /proc/self/smaps) in the mappings that hold
    `tensors`; 0 where that cannot be read. Read at every start for its log line, so only
    each mapping's first line and its AnonHugePages line are parsed, the tensors found by
    bisection: splitting all ~9,800 lines and testing every tensor against every mapping took
    17-28 ms, now 12, of which ~10 are the kernel writing the file."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    starts = sorted({t.data_ptr() for t in tensors if t.nbytes})
    total, inside = 0, False
    for line in lines:
        if line.startswith("AnonHugePages:"):
            if inside:
                total += int(line.split()[1]) * 1024
        elif line[:1] in _HEX and not line.split(" ", 1)[0].endswith(":"):
            low, _, high = line.split(" ", 1)[0].partition("-")
            at = bisect.bisect_left(starts, int(low, 16))
            inside = at < len(starts) and starts[at] < int(high, 16)
    return total


_HEX = frozenset("0123456789abcdef")
