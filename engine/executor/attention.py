"""Paged attention: the C++ kernel on CPU, torch (SDPA) where it is not built (CUDA,
`--no-compile`).

A step's tokens are flattened: first the prefill spans (sequences feeding 2+ new tokens, in
order), then one token per decoding sequence. New K/V rows are written into the pool through
`slot_mapping` before attention reads them.

The kernel (`torch.ops.prefixgate.paged_attention`, engine/executor/kernels/paged_attention.cpp)
serves every query the same way: a query at position p attends to keys 0..p (its last
`window` keys in a sliding-window layer) in fixed positional chunks merged in a fixed order,
so its result does not depend on whether it came in a whole prefill, a suffix after a cache
hit, a decode step, a recompute, or beside which other sequences. `KernelPlan` is what it
reads, built once per forward (and once more for a window).

The torch path (`TorchAttention`) is for devices without the kernel: prefill spans through
SDPA, decodes gathered and masked, and decodes that share a registry prefix's blocks as a
cascade (the prefix once for the whole group, merged with each private suffix by their
log-sum-exp). SDPA's reduction order depends on the shapes it is given, so on this path the
same request can get different bits in different batches (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def use_cuda_sdpa_without_cudnn() -> str:
    """On CUDA, SDPA picks among flash, memory-efficient and cuDNN kernels; with bf16 on a
    Hopper GPU it picks cuDNN, which builds (and caches) an execution graph for every new
    shape. Our shapes change with every prompt length and context, so a lent H100 showed
    cuDNN's attention at 72 us of host time a call against 27 us for the memory-efficient
    kernel in float32, and bf16 first tokens 5x slower than float32 (docs/benchmarks.md).
    Flash and memory-efficient attention plan nothing per shape; the math path stays as the
    fallback for shapes neither takes. Process-wide, as torch's switch is; returns the line
    for the start-up log."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    return "flash / memory-efficient SDPA (cuDNN attention off: a graph per new shape)"


@dataclass(slots=True)
class PrefillSpan:
    """`num_new_tokens` queries at positions [num_cached, num_cached + num_new_tokens)."""

    token_start: int
    num_new_tokens: int
    num_cached: int
    block_ids: torch.Tensor  # [num_blocks] long, on the device
    # additive [group * num_new, num_cached + num_new] (see `prefill_mask`); None: plain causal
    # (nothing cached, no window cutting the span)
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences attended together; with `prefix_blocks`, as a cascade."""

    rows: torch.Tensor  # [G] long: positions among the step's decode rows
    # shared leading blocks: a slice when consecutive (read in place), else [k] long ids;
    # None: a plain group
    prefix_blocks: slice | torch.Tensor | None
    block_tables: torch.Tensor  # [G, max_blocks] long: each sequence's blocks after the prefix
    context_lens: torch.Tensor  # [G] long: tokens each sequence attends to after the prefix
    # [G, 1, 1, max_blocks * block_size] additive: 0 valid, -inf padding (and outside a window)
    mask: torch.Tensor


@dataclass(slots=True)
class KernelPlan:
    """The kernel's view of a step: each query's sequence row in the block table and the
    work split `attention_plan` made of them (shared by every layer with its window)."""

    block_tables: torch.Tensor  # [rows, max_blocks] long: the input batch's table
    seq_rows: torch.Tensor  # [num_tokens] long: each query's row
    positions: torch.Tensor  # [num_tokens] long
    items: torch.Tensor  # [num_items, 3] long: (chunk, first member, member count)
    members: torch.Tensor  # [num_members] long: query indices, tile by tile
    part_start: torch.Tensor  # [num_tokens + 1] long: each query's first partial result
    window: int  # 0: each query sees keys 0..p; else its last `window` keys

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_rows: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        window: int = 0,
    ) -> KernelPlan:
        items, members, part_start = torch.ops.prefixgate.attention_plan(
            block_tables, seq_rows, positions, block_size, window
        )
        return cls(block_tables, seq_rows, positions, items, members, part_start, window)


@dataclass(slots=True)
class TorchAttention:
    """The torch path's view of a step: prefill spans, then decode groups."""

    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_groups: list[DecodeGroup]  # every decode row in exactly one group


@dataclass(slots=True)
class ForwardBatch:
    """Everything one model forward needs besides the weights; built once per step."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    logits_indices: torch.Tensor  # [num_sampled] long: rows of the hidden states to project
    attention: KernelPlan | TorchAttention
    # The same step for sliding-window layers (each query sees its last `window` keys): built
    # only for a model that has them
    windowed: KernelPlan | TorchAttention | None = None

    @property
    def use_cpu_kernels(self) -> bool:
        """The C++ CPU ops serve this forward: attention and the layers' fused norm / SwiGLU /
        RoPE + K/V store (else torch ops only)."""
        return isinstance(self.attention, KernelPlan)


def prefill_mask(
    num_cached: int,
    num_new: int,
    group: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int = 0,
) -> torch.Tensor:
    """Causal mask with an offset, additive: query i (position num_cached + i) sees keys
    0..num_cached+i (with a window, only the last `window` of them). Repeated `group` times:
    the query heads sharing a KV head are folded into the query axis (see `_span_attention`)."""
    q_pos = torch.arange(num_new, device=device) + num_cached  # [num_new]
    k_pos = torch.arange(num_cached + num_new, device=device)  # [ctx]
    visible = k_pos[None, :] <= q_pos[:, None]  # [num_new, ctx]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
        ~visible, float("-inf")
    )
    return mask.repeat(group, 1)  # [group * num_new, ctx]


def decode_mask(
    context_lens: torch.Tensor, max_len: int, dtype: torch.dtype, window: int = 0
) -> torch.Tensor:
    """Additive mask (0 for a sequence's keys, or with a window its last `window` keys; -inf
    for the rest and padding): the CPU flash kernel that returns the log-sum-exp only takes
    masks in the query's dtype."""
    keys = torch.arange(max_len, device=context_lens.device)[None, :]
    valid = keys < context_lens[:, None]
    if window:
        valid &= keys >= context_lens[:, None] - window
    valid = valid[:, None, None, :]  # [B, 1, 1, max_len]
    zeros = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return zeros.masked_fill_(~valid, float("-inf"))


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long
) -> None:
    """Write the step's new K/V rows into the pool at their slots (in the pool's dtype),
    before attention reads them. (Llama's C++ path does this inside its RoPE kernel.)"""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of the step's queries; their K/V rows are already in the pool (`store_kv`).
    `sliding`: a sliding-window layer's (the batch's `windowed` view of the step)."""
    plan = batch.windowed if sliding else batch.attention
    assert plan is not None, "a sliding-window layer in a batch built without its window"
    if isinstance(plan, KernelPlan):
        out: torch.Tensor = torch.ops.prefixgate.paged_attention(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.seq_rows,
            plan.positions,
            plan.items,
            plan.members,
            plan.part_start,
            scale,
            plan.window,
        )
        return out
    return _torch_attention(q, k, v, k_cache, v_cache, plan, scale)


def _torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttention,
    scale: float,
) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2:]
    if not plan.prefills and len(plan.decode_groups) == 1:  # every row in one group
        return _group_attention(q, k_cache, v_cache, plan.decode_groups[0], scale)
    out = torch.empty_like(q)
    for span in plan.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new_tokens)
        if span.num_cached == 0:  # nothing cached: attend to the fresh K/V, no gather
            span_k, span_v = k[rows], v[rows]
        else:
            ctx = span.num_cached + span.num_new_tokens
            span_k = k_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx].to(q.dtype)
            span_v = v_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx].to(q.dtype)
        out[rows] = _span_attention(q[rows], span_k, span_v, span.mask, scale)
    if plan.decode_groups:
        start = plan.num_prefill_tokens
        decode_q, decode_out = q[start:], out[start:]
        for group in plan.decode_groups:
            # one group (the common case) needs no row shuffling
            group_rows = slice(None) if len(plan.decode_groups) == 1 else group.rows
            decode_out[group_rows] = _group_attention(
                decode_q[group_rows], k_cache, v_cache, group, scale
            )
    return out


def _span_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k: torch.Tensor,  # [ctx, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [group * n, ctx] additive, None: plain causal (nothing cached)
    scale: float,
) -> torch.Tensor:
    # 4-D inputs: the CPU flash kernel only takes batched 4-D tensors (3-D falls back to the
    # math path, which materialises every score and was half of prefill time).
    keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv, ctx, d]
    if mask is None:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, is_causal=True, scale=scale, enable_gqa=True
        )  # [1, num_heads, n, head_dim]
        return o[0].transpose(0, 1)
    # With a cached context, fold each KV head's query heads into the query axis: 3 heads of
    # 3 * n rows run 1.5x faster in the CPU flash kernel than 9 heads of n rows with GQA.
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kv, group, n, d]
    qf = qf.reshape(1, num_kv_heads, group * n, head_dim)
    o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)
    o = o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)  # [n, kv, group, d]
    return o.reshape(n, num_heads, head_dim)


def _group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    if group.prefix_blocks is not None:
        return _cascade_attention(q, k_cache, v_cache, group, scale)
    return _decode_attention(q, k_cache, v_cache, group.block_tables, group.mask, scale)


def _cascade_attention(
    q: torch.Tensor,  # [G, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    assert group.prefix_blocks is not None
    g, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    # Shared prefix, once: every query row of the group against the same keys.
    kp = k_cache[group.prefix_blocks].flatten(0, 1).transpose(0, 1)[None].to(q.dtype)
    vp = v_cache[group.prefix_blocks].flatten(0, 1).transpose(0, 1)[None].to(q.dtype)
    qp = q.view(g, num_kv_heads, per_kv, head_dim).transpose(0, 1)
    qp = qp.reshape(1, num_kv_heads, g * per_kv, head_dim)  # [1, kv, G * per_kv, d]
    o_p, lse_p = attention_with_lse(qp, kp, vp, None, scale)
    o_p = o_p.view(num_kv_heads, g, per_kv, head_dim).transpose(0, 1)  # [G, kv, per_kv, d]
    lse_p = lse_p.view(num_kv_heads, g, per_kv).transpose(0, 1)  # [G, kv, per_kv]
    # Private suffixes, per sequence: gathered and masked.
    keys, values = _gather(k_cache, v_cache, group.block_tables, q.dtype)
    qg = q.view(g, num_kv_heads, per_kv, head_dim)
    o_s, lse_s = attention_with_lse(qg, keys, values, group.mask, scale)
    # Merge the two partial softmaxes: the prefix's share of the whole is
    # exp(lse_p) / (exp(lse_p) + exp(lse_s)) = sigmoid(lse_p - lse_s).
    w_p = torch.sigmoid(lse_p - lse_s)[..., None]
    o = torch.lerp(o_s.float(), o_p.float(), w_p)
    return o.to(q.dtype).reshape(g, num_heads, head_dim)


def _decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    mask: torch.Tensor,  # [B, 1, 1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = _gather(k_cache, v_cache, block_tables, q.dtype)
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, kv, group, d]
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks: [B, max_blocks, block_size, kv, d] -> [B, kv, L, d], in the
    queries' dtype."""
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2).to(dtype)
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2).to(dtype)
    return keys, values


def attention_with_lse(
    q: torch.Tensor,  # [B, H, Lq, d]
    k: torch.Tensor,  # [B, H, Lk, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # additive, broadcastable to [B, H, Lq, Lk], q's dtype
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, H, Lq, d], log-sum-exp [B, H, Lq] float32
    """Attention that also returns the softmax's log-sum-exp, which cascade merging needs
    (public SDPA does not return it). On CPU this is the flash kernel SDPA itself runs (2-3x
    faster than the matmul-softmax-matmul below, which other devices use)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(q.dtype), v)
    return out, lse
