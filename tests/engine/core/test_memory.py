"""HugePageArena: tensors copied or read into one mapping advised for 2 MB pages."""

from __future__ import annotations

import pytest
import torch

from engine.core.memory import (
    HUGE_PAGE,
    HugePageArena,
    huge_page_bytes,
    huge_pages_available,
    transparent_huge_pages,
)


def test_tensors_lie_back_to_back_from_a_huge_page_boundary() -> None:
    tensors = [torch.randn(1000), torch.arange(7, dtype=torch.int8), torch.randn(3, 5).half()]
    arena = HugePageArena(sum(HugePageArena.span(t.nbytes) for t in tensors))
    placed = [arena.place(t) for t in tensors]
    assert placed[0].data_ptr() % HUGE_PAGE == 0
    offsets = [p.data_ptr() - placed[0].data_ptr() for p in placed]
    assert offsets == [0, 4000 // 64 * 64 + 64, 4000 // 64 * 64 + 128]  # 64-byte starts
    for original, copy in zip(tensors, placed, strict=True):
        assert copy.dtype == original.dtype and torch.equal(copy, original)
        assert copy.data_ptr() != original.data_ptr()
    with pytest.raises(ValueError, match="full"):
        arena.empty(1)


def test_an_arenas_tensors_outlive_the_arena_object() -> None:
    arena = HugePageArena(HugePageArena.span(4096))
    kept = arena.place(torch.full((1024,), 3.0))
    del arena
    kept.add_(1)
    assert torch.equal(kept, torch.full((1024,), 4.0))


def test_an_arena_is_backed_by_huge_pages_where_the_kernel_grants_them() -> None:
    if not huge_pages_available():
        pytest.skip(f"transparent huge pages: {transparent_huge_pages() or 'none'}")
    arena = HugePageArena(3 * HUGE_PAGE)
    data = arena.empty(3 * HUGE_PAGE)
    data.fill_(1)  # resident now
    assert huge_page_bytes([data]) >= 3 * HUGE_PAGE


def test_an_arena_works_where_the_kernel_refuses_the_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel built without THP answers MADV_HUGEPAGE with EINVAL (an unknown advice here):
    the arena is then plain memory, not a failed load."""
    monkeypatch.setattr("engine.core.memory.mmap.MADV_HUGEPAGE", 12345, raising=False)
    arena = HugePageArena(HugePageArena.span(64))
    assert torch.equal(arena.place(torch.arange(16.0)), torch.arange(16.0))
