"""Paged attention in plain torch (SDPA), for CPU and CUDA.

A step's tokens are flattened: first the prefill spans (sequences feeding 2+ new tokens, in
order), then one token per decoding sequence. New K/V rows are written into the pool through
`slot_mapping` before attention reads them, so a span's queries see the cached prefix (shared
prefix blocks included) plus themselves.

GQA never repeats K/V: prefill spans use SDPA's `enable_gqa`; decodes fold the `group` query
heads that share a KV head into the query axis (`[B, kv_heads, group, head_dim]`).

Decodes that share a registry prefix's blocks are attended as a cascade: the shared prefix
once for the whole group (all the group's queries in one attention call), each sequence's
private suffix on its own, and the two partial softmaxes merged by their log-sum-exp. Without
it every sequence re-gathers the same ~1000 prefix tokens at every step. A registry prefix
filled into consecutive blocks (the usual case: the pool hands out fresh blocks in id order)
is read in place, without a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """`num_new_tokens` queries at positions [num_cached, num_cached + num_new_tokens)."""

    token_start: int
    num_new_tokens: int
    num_cached: int
    block_ids: torch.Tensor  # [num_blocks] long, on the device
    # additive [group * num_new, num_cached + num_new] (see `prefill_mask`); None: nothing cached
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
    # [G, 1, 1, max_blocks * block_size] additive: 0 valid, -inf padding; None when the paged
    # decode kernel reads the blocks in place (it needs only `context_lens`)
    mask: torch.Tensor | None


@dataclass(slots=True)
class ForwardBatch:
    """Everything one model forward needs besides the weights; built once per step."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_groups: list[DecodeGroup]  # every decode row in exactly one group
    logits_indices: torch.Tensor  # [num_sampled] long: rows of the hidden states to project
    # the C++ CPU ops of engine.kernels: decode attention (`paged_decode_attention`) and the
    # layers' fused norm / SwiGLU / RoPE + K/V store; False: torch ops only
    use_cpu_kernels: bool = False

    @property
    def decode_only(self) -> bool:
        """No prefill span in this step: quantized linears may use their int4 kernel."""
        return not self.prefills


def prefill_mask(
    num_cached: int, num_new: int, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Causal mask with an offset, additive: query i (position num_cached + i) sees keys
    0..num_cached+i. Repeated `group` times: the query heads sharing a KV head are folded into
    the query axis (see `_span_attention`)."""
    q_pos = torch.arange(num_new, device=device) + num_cached  # [num_new]
    k_pos = torch.arange(num_cached + num_new, device=device)  # [ctx]
    visible = k_pos[None, :] <= q_pos[:, None]  # [num_new, ctx]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
        ~visible, float("-inf")
    )
    return mask.repeat(group, 1)  # [group * num_new, ctx]


def decode_mask(context_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (0 for a sequence's keys, -inf for padding): the CPU flash kernel that
    returns the log-sum-exp only takes masks in the query's dtype."""
    keys = torch.arange(max_len, device=context_lens.device)
    valid = (keys[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, max_len]
    zeros = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return zeros.masked_fill_(~valid, float("-inf"))


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long
) -> None:
    """Write the step's new K/V rows into the pool at their slots, before attention reads
    them. (Llama's C++ path does this inside its RoPE kernel.)"""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of the step's queries; their K/V rows are already in the pool (`store_kv`)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    if not batch.prefills and len(batch.decode_groups) == 1:  # every row in one group
        group = batch.decode_groups[0]
        return _group_attention(q, k_cache, v_cache, group, scale, batch.use_cpu_kernels)
    out = torch.empty_like(q)
    for span in batch.prefills:
        rows = slice(span.token_start, span.token_start + span.num_new_tokens)
        if span.num_cached == 0:  # nothing cached: attend to the fresh K/V, no gather
            span_k, span_v = k[rows], v[rows]
        else:
            ctx = span.num_cached + span.num_new_tokens
            span_k = k_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
            span_v = v_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
        out[rows] = _span_attention(q[rows], span_k, span_v, span.mask, scale)
    if batch.decode_groups:
        start = batch.num_prefill_tokens
        decode_q, decode_out = q[start:], out[start:]
        for group in batch.decode_groups:
            # one group (the common case) needs no row shuffling
            group_rows = slice(None) if len(batch.decode_groups) == 1 else group.rows
            decode_out[group_rows] = _group_attention(
                decode_q[group_rows], k_cache, v_cache, group, scale, batch.use_cpu_kernels
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
    use_kernel: bool,
) -> torch.Tensor:
    if group.prefix_blocks is not None:
        return _cascade_attention(q, k_cache, v_cache, group, scale, use_kernel)
    if use_kernel:
        out_lse: tuple[torch.Tensor, torch.Tensor] = torch.ops.prefixgate.paged_decode_attention(
            q, k_cache, v_cache, group.block_tables, group.context_lens, scale
        )
        return out_lse[0]
    assert group.mask is not None
    return _decode_attention(q, k_cache, v_cache, group.block_tables, group.mask, scale)


def _cascade_attention(
    q: torch.Tensor,  # [G, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    use_kernel: bool,
) -> torch.Tensor:
    assert group.prefix_blocks is not None
    g, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    # Shared prefix, once: every query row of the group against the same keys.
    kp = k_cache[group.prefix_blocks].flatten(0, 1).transpose(0, 1)[None]  # [1, kv, P, d]
    vp = v_cache[group.prefix_blocks].flatten(0, 1).transpose(0, 1)[None]
    qp = q.view(g, num_kv_heads, per_kv, head_dim).transpose(0, 1)
    qp = qp.reshape(1, num_kv_heads, g * per_kv, head_dim)  # [1, kv, G * per_kv, d]
    o_p, lse_p = attention_with_lse(qp, kp, vp, None, scale)
    o_p = o_p.view(num_kv_heads, g, per_kv, head_dim).transpose(0, 1)  # [G, kv, per_kv, d]
    lse_p = lse_p.view(num_kv_heads, g, per_kv).transpose(0, 1)  # [G, kv, per_kv]
    # Private suffixes, per sequence: read in place by the kernel, else gathered and masked.
    if use_kernel:
        o_s, lse_s = torch.ops.prefixgate.paged_decode_attention(
            q, k_cache, v_cache, group.block_tables, group.context_lens, scale
        )
        o_s = o_s.view(g, num_kv_heads, per_kv, head_dim)
        lse_s = lse_s.view(g, num_kv_heads, per_kv)
    else:
        keys, values = _gather(k_cache, v_cache, group.block_tables)
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
    keys, values = _gather(k_cache, v_cache, block_tables)
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, kv, group, d]
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks: [B, max_blocks, block_size, kv, d] -> [B, kv, L, d] views."""
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
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
