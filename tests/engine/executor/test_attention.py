"""Paged attention kernels against a dense reference: prefill spans, decodes, cascades, and
the C++ paged decode kernel (engine/kernels) against the same references."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import default_cache_dir
from engine.executor.attention import (
    DecodeGroup,
    _cascade_attention,
    _decode_attention,
    _span_attention,
    attention_with_lse,
    decode_mask,
    prefill_mask,
)
from engine.executor.kernels import load_cpu_kernels

NUM_BLOCKS, BLOCK, KV, HEADS, DIM = 32, 4, 2, 6, 8


@pytest.fixture(scope="module")
def kernels() -> None:
    assert load_cpu_kernels(default_cache_dir()), "the C++ decode kernel did not build"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query [heads, d] over one sequence's keys [L, kv, d], dense softmax."""
    kr = k.repeat_interleave(HEADS // KV, dim=1)  # [L, heads, d]
    vr = v.repeat_interleave(HEADS // KV, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kr.double()) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), vr.double()).to(q.dtype)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [[3, 7, 1], [4, 5, 6]], ids=["gathered", "consecutive"])
def test_cascade_equals_plain_decode_and_dense_reference(
    dtype: torch.dtype, shared: list[int], use_kernel: bool, request: pytest.FixtureRequest
) -> None:
    if use_kernel:
        request.getfixturevalue("kernels")
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV, DIM, generator=gen).to(dtype)
    # three full blocks of a registry prefix; consecutive ones are read in place (a slice)
    consecutive = shared == list(range(shared[0], shared[0] + len(shared)))
    private = [[10, 11], [12], [13, 14, 15]]  # each sequence's own blocks after it
    lens = [6, 2, 9]  # tokens after the prefix (the last one is being decoded)
    q = torch.randn(3, HEADS, DIM, generator=gen).to(dtype)
    scale = DIM**-0.5
    max_blocks = 3
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in private])
    group = DecodeGroup(
        rows=torch.arange(3),
        prefix_blocks=slice(shared[0], shared[-1] + 1) if consecutive else torch.tensor(shared),
        block_tables=tables,
        context_lens=torch.tensor(lens),
        mask=None if use_kernel else decode_mask(torch.tensor(lens), max_blocks * BLOCK, dtype),
    )
    cascade = _cascade_attention(q, k_cache, v_cache, group, scale, use_kernel)
    full_tables = torch.tensor([shared + t + [0] * (max_blocks - len(t)) for t in private])
    full_lens = torch.tensor([len(shared) * BLOCK + n for n in lens])
    plain = _decode_attention(
        q,
        k_cache,
        v_cache,
        full_tables,
        decode_mask(full_lens, (len(shared) + max_blocks) * BLOCK, dtype),
        scale,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascade, plain, rtol=tol, atol=tol)
    for i in range(3):
        blocks = shared + private[i]
        k = k_cache[blocks].flatten(0, 1)[: full_lens[i]]
        v = v_cache[blocks].flatten(0, 1)[: full_lens[i]]
        torch.testing.assert_close(cascade[i], _reference(q[i], k, v, scale), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_lse_matches_dense_softmax(dtype: torch.dtype) -> None:
    """The CPU flash kernel's output and log-sum-exp, masked padding included."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, KV, 3, DIM, generator=gen).to(dtype)
    k = torch.randn(2, KV, 10, DIM, generator=gen).to(dtype)
    v = torch.randn(2, KV, 10, DIM, generator=gen).to(dtype)
    mask = decode_mask(torch.tensor([10, 4]), 10, dtype)
    out, lse = attention_with_lse(q, k, v, mask, 0.3)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * 0.3 + mask.double()
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    torch.testing.assert_close(out, ref.to(dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_over_cached_context_is_causal_with_offset(dtype: torch.dtype) -> None:
    """A chunk of 5 new tokens after 7 cached ones: query i sees keys 0..7+i (GQA folded)."""
    gen = torch.Generator().manual_seed(2)
    num_cached, n = 7, 5
    q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(num_cached + n, KV, DIM, generator=gen).to(dtype)
    v = torch.randn(num_cached + n, KV, DIM, generator=gen).to(dtype)
    mask = prefill_mask(num_cached, n, HEADS // KV, dtype, torch.device("cpu"))
    out = _span_attention(q, k, v, mask, DIM**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(n):
        ctx = num_cached + i + 1
        ref = _reference(q[i], k[:ctx], v[:ctx], DIM**-0.5)
        torch.testing.assert_close(out[i], ref, rtol=tol, atol=tol)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "lens"),
    [
        (4, DIM, [1, 5, 23]),  # head_dim read at run time
        (16, 64, [1, 256, 257, 700]),  # compiled head_dim; split at 128-token chunks
        (16, 128, [3, 512, 40]),
        (32, 64, [1000, 1, 65]),
    ],
)
def test_paged_decode_kernel_matches_dense_reference(
    dtype: torch.dtype, block_size: int, head_dim: int, lens: list[int]
) -> None:
    """Blocks scattered through the pool, read in place; output and log-sum-exp exact to the
    dtype's precision; padded table entries are never read."""
    gen = torch.Generator().manual_seed(3)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, KV, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KV, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: padding only
    tables, start = [], 0
    for n in lens:
        used = -(-n // block_size)
        tables.append(order[start : start + used].tolist() + [0] * (max_blocks - used))
        start += used
    k_cache[0] = float("nan")  # a padded entry that was read would poison the output
    v_cache[0] = float("nan")
    q = torch.randn(len(lens), HEADS, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out, lse = torch.ops.prefixgate.paged_decode_attention(
        q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), scale
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].flatten(0, 1)[:n].double()  # [n, kv, d]
        v = v_cache[tables[i]].flatten(0, 1)[:n].double()
        kr, vr = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), kr) * scale
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), vr)
        torch.testing.assert_close(out[i].double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[i].double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
