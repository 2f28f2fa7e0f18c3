"""Paged attention kernels against a dense reference: prefill spans, decodes, cascades."""

from __future__ import annotations

import pytest
import torch

from engine.attention import DecodeGroup, _cascade_attention, _decode_attention, decode_mask

NUM_BLOCKS, BLOCK, KV, HEADS, DIM = 32, 4, 2, 6, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query [heads, d] over one sequence's keys [L, kv, d], dense softmax."""
    kr = k.repeat_interleave(HEADS // KV, dim=1)  # [L, heads, d]
    vr = v.repeat_interleave(HEADS // KV, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kr.double()) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), vr.double()).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_plain_decode_and_dense_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV, DIM, generator=gen).to(dtype)
    shared = [3, 7, 1]  # three full blocks of a registry prefix
    private = [[10, 11], [12], [13, 14, 15]]  # each sequence's own blocks after it
    lens = [6, 2, 9]  # tokens after the prefix (the last one is being decoded)
    q = torch.randn(3, HEADS, DIM, generator=gen).to(dtype)
    scale = DIM**-0.5
    max_blocks = 3
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in private])
    group = DecodeGroup(
        rows=torch.arange(3),
        prefix_block_ids=torch.tensor(shared),
        block_tables=tables,
        mask=decode_mask(torch.tensor(lens), max_blocks * BLOCK),
    )
    cascade = _cascade_attention(q, k_cache, v_cache, group, scale)
    full_tables = torch.tensor([shared + t + [0] * (max_blocks - len(t)) for t in private])
    full_lens = torch.tensor([len(shared) * BLOCK + n for n in lens])
    plain = _decode_attention(
        q,
        k_cache,
        v_cache,
        full_tables,
        decode_mask(full_lens, (len(shared) + max_blocks) * BLOCK),
        scale,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascade, plain, rtol=tol, atol=tol)
    for i in range(3):
        blocks = shared + private[i]
        k = k_cache[blocks].flatten(0, 1)[: full_lens[i]]
        v = v_cache[blocks].flatten(0, 1)[: full_lens[i]]
        torch.testing.assert_close(cascade[i], _reference(q[i], k, v, scale), rtol=tol, atol=tol)
