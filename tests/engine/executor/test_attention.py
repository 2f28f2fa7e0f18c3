"""Paged attention against a dense reference: the C++ kernel (every query of a step, any KV
storage dtype) and the torch path's prefill spans, decodes and cascades; and the kernel's
promise, that a query's bits do not depend on what else the call holds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.core.config import default_cache_dir
from engine.executor.attention import (
    DecodeGroup,
    KernelPlan,
    _cascade_attention,
    _decode_attention,
    _span_attention,
    attention_with_lse,
    decode_mask,
    prefill_mask,
    use_cuda_sdpa_without_cudnn,
)
from engine.executor.kernels import load_cpu_kernels
from tests.engine.executor.cpu_flags import cpu_flags, linux_grants_amx

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [[3, 7, 1], [4, 5, 6]], ids=["gathered", "consecutive"])
def test_cascade_equals_plain_decode_and_dense_reference(
    dtype: torch.dtype, shared: list[int]
) -> None:
    """The torch path's cascade (devices without the kernel)."""
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
        mask=decode_mask(torch.tensor(lens), max_blocks * BLOCK, dtype),
    )
    cascade = _cascade_attention(q, k_cache, v_cache, group, scale)
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


@dataclass
class Query:
    seq: int  # which sequence (row of the block table)
    pos: int  # attends to keys 0..pos


def _kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    queries: list[Query],
    block_size: int,
    window: int = 0,
) -> torch.Tensor:
    plan = KernelPlan.build(
        tables,
        torch.tensor([x.seq for x in queries]),
        torch.tensor([x.pos for x in queries]),
        block_size,
        window,
    )
    out: torch.Tensor = torch.ops.prefixgate.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        plan.seq_rows,
        plan.positions,
        plan.items,
        plan.members,
        plan.part_start,
        q.shape[-1] ** -0.5,
        plan.window,
    )
    return out


def _pool(
    gen: torch.Generator, lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches with each sequence's blocks scattered through the pool, block 0 NaN (a read
    of a padded table entry would poison the output), and the block tables."""
    max_blocks = -(-max(lens) // block_size) + 2  # stale entries past each row's blocks
    num_blocks = len(lens) * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, KV, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KV, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables, start = [], 0
    for n in lens:
        used = -(-n // block_size)
        tables.append(order[start : start + used].tolist() + [0] * (max_blocks - used))
        start += used
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    return k_cache, v_cache, torch.tensor(tables)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "lens", "window"),
    [
        (4, DIM, [1, 5, 23], 0),  # head_dim read at run time
        (16, 64, [1, 256, 257, 700], 0),  # compiled head_dim; several 128-token chunks
        (16, 128, [3, 512, 40], 0),
        (12, 64, [300, 1, 65], 0),  # chunks that end inside a block
        (16, 256, [1, 700, 200, 130], 200),  # a window across chunk borders (Gemma 3's dim)
        (4, DIM, [1, 5, 23, 140], 7),  # a window inside one chunk, or across one border
        (16, 64, [300, 129, 128], 128),  # a window of exactly one chunk
    ],
)
def test_paged_attention_kernel_matches_dense_reference(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    lens: list[int],
    window: int,
) -> None:
    """Each sequence's last 1-20 positions as queries (a prefill span's causal tail, or one
    decode), blocks read in place, whatever the storage dtype; with a window, each query sees
    its last `window` keys."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = _pool(gen, lens, block_size, head_dim, kv_dtype)
    queries = [Query(i, p) for i, n in enumerate(lens) for p in range(max(0, n - 1 - i * 7), n)]
    q = torch.randn(len(queries), HEADS, head_dim, generator=gen).to(q_dtype)
    out = _kernel(q, k_cache, v_cache, tables, queries, block_size, window)
    tol = 2e-5 if q_dtype == torch.float32 else 2e-2
    for row, query in enumerate(queries):
        blocks = tables[query.seq]
        first = max(0, query.pos + 1 - window) if window else 0
        k = k_cache[blocks].flatten(0, 1)[first : query.pos + 1].double()  # [ctx, kv, d]
        v = v_cache[blocks].flatten(0, 1)[first : query.pos + 1].double()
        kr, vr = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), kr) * head_dim**-0.5
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), vr)
        torch.testing.assert_close(out[row].double(), ref, rtol=tol, atol=tol)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("window", [0, 150], ids=["full", "window"])
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),  # bf16 pair products where the CPU has them
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_query_gets_the_same_bits_whatever_else_the_call_holds(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, window: int
) -> None:
    """Batch invariance: 300 positions of one sequence computed as one prefill, in chunks of
    several sizes, one query at a time (decodes), and beside other sequences' queries that
    share its first 10 blocks (a registry prefix) or not: every query's output is the same,
    bit for bit, with or without a sliding window."""
    gen = torch.Generator().manual_seed(4)
    block_size, n = 16, 300
    k_cache, v_cache, tables = _pool(gen, [n, n, 200], block_size, head_dim, kv_dtype)
    tables[1, :10] = tables[0, :10]  # sequence 1 shares sequence 0's first 160 tokens
    q_all = torch.randn(n, HEADS, head_dim, generator=gen).to(q_dtype)
    whole = _kernel(
        q_all, k_cache, v_cache, tables, [Query(0, p) for p in range(n)], block_size, window
    )
    for chunk in (1, 16, 100, 129):
        parts = [
            _kernel(
                q_all[s : s + chunk],
                k_cache,
                v_cache,
                tables,
                [Query(0, p) for p in range(s, min(n, s + chunk))],
                block_size,
                window,
            )
            for s in range(0, n, chunk)
        ]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk}"
    # beside others: sequence 1 (shared blocks) and 2 decoding, in front of and behind it
    others = torch.randn(4, HEADS, head_dim, generator=gen).to(q_dtype)
    mixed_queries = [
        Query(1, 250),
        Query(2, 199),
        *(Query(0, p) for p in range(n)),
        Query(1, 170),
        Query(2, 5),
    ]
    mixed = _kernel(
        torch.cat([others[:2], q_all, others[2:]]),
        k_cache,
        v_cache,
        tables,
        mixed_queries,
        block_size,
        window,
    )
    assert torch.equal(mixed[2 : 2 + n], whole)
    alone = _kernel(others[:1], k_cache, v_cache, tables, [Query(1, 250)], block_size, window)
    assert torch.equal(mixed[0], alone[0])


@pytest.mark.usefixtures("kernels")
def test_the_plan_shares_a_chunk_read_between_sequences_with_the_same_blocks() -> None:
    """Decodes whose first 128 tokens sit in the same blocks read that chunk once, as one
    tile; the chunk where their blocks part is read per sequence."""
    block_size = 16
    shared = list(range(1, 11))  # 160 tokens: chunk 0 whole, chunk 1 partly
    tables = torch.tensor([[*shared, 20 + i, 30 + i] for i in range(3)])
    plan = KernelPlan.build(
        tables, torch.tensor([0, 1, 2]), torch.tensor([190, 170, 180]), block_size
    )
    items = [tuple(row) for row in plan.items.tolist()]
    chunk0 = [it for it in items if it[0] == 0]
    assert len(chunk0) == 1 and chunk0[0][2] == 3  # one tile of all three
    assert sorted(it[2] for it in items if it[0] == 1) == [1, 1, 1]
    assert plan.part_start.tolist() == [0, 2, 4, 6]


@pytest.mark.usefixtures("kernels")
def test_a_windowed_plan_reads_only_the_chunks_in_the_window() -> None:
    """A query at 300 with a 100-key window sees keys 201..300: chunks 1 and 2, never 0; one
    at 50 sees chunk 0 only."""
    block_size = 16
    tables = torch.arange(1, 21)[None]
    plan = KernelPlan.build(tables, torch.tensor([0, 0]), torch.tensor([300, 50]), block_size, 100)
    assert sorted(row[0] for row in plan.items.tolist()) == [0, 1, 2]
    assert plan.part_start.tolist() == [0, 2, 3]
    assert plan.window == 100


def test_cuda_sdpa_leaves_out_cudnn_and_keeps_the_shape_free_kernels() -> None:
    """cuDNN's attention builds a graph per new shape (every prompt length is one); the
    kernels that plan nothing per shape, and the math fallback, stay on."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert "cuDNN attention off" in use_cuda_sdpa_without_cudnn()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("kernels")
def test_bf16_attention_takes_the_pair_products_where_the_cpu_has_them() -> None:
    """The start-up line names the path bf16 attention takes: AMX tiles where the CPU has
    them (with AVX512-BF16), the build targets it and Linux grants them; else VDPBF16PS in
    vectors where the CPU has AVX512-BF16 (Zen 4) and the build targets it; the vector path
    otherwise. The tests above then check that path's invariance and accuracy on this CPU."""
    from engine.executor.kernels import kernel_target

    flags = cpu_flags()
    pairs = kernel_target() == "avx512" and {"avx512_bf16", "avx512bw"} <= flags
    tiles = pairs and {"amx_tile", "amx_bf16"} <= flags and linux_grants_amx()
    want = "amx-bf16" if tiles else "avx512-bf16" if pairs else "vector"
    assert torch.ops.prefixgate.attention_path() == want
