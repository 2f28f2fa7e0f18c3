"""Paged attention in plain torch (SDPA), for CPU and CUDA.

A step's tokens are flattened: first the prefill spans (sequences feeding 2+ new tokens, in
order), then one token per decoding sequence. New K/V rows are written into the pool through
`slot_mapping` before attention reads them, so a span's queries see the cached prefix (shared
prefix blocks included) plus themselves.

GQA never repeats K/V: prefill spans use SDPA's `enable_gqa`; decodes fold the `group` query
heads that share a KV head into the query axis (`[B, kv_heads, group, head_dim]`).
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
    mask: torch.Tensor | None  # [num_new, num_cached + num_new] bool; None: nothing cached


@dataclass(slots=True)
class ForwardBatch:
    """Everything one model forward needs besides the weights; built once per step."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    logits_indices: torch.Tensor  # [num_sampled] long: rows of the hidden states to project


def prefill_mask(num_cached: int, num_new: int, device: torch.device) -> torch.Tensor:
    """Causal mask with an offset: query i (position num_cached + i) sees keys 0..num_cached+i."""
    q_pos = torch.arange(num_new, device=device) + num_cached  # [num_new]
    k_pos = torch.arange(num_cached + num_new, device=device)  # [ctx]
    return k_pos[None, :] <= q_pos[:, None]  # [num_new, ctx]


def decode_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    keys = torch.arange(max_len, device=context_lens.device)
    return (keys[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, max_len]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
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
    if batch.decode_block_tables is not None:
        start = batch.num_prefill_tokens
        out[start:] = _decode_attention(
            q[start:], k_cache, v_cache, batch.decode_block_tables, batch.decode_mask, scale
        )
    return out


def _span_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    k: torch.Tensor,  # [ctx, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [n, ctx] bool, None: plain causal (nothing cached)
    scale: float,
) -> torch.Tensor:
    # 4-D inputs: the CPU flash kernel only takes batched 4-D tensors (3-D falls back to the
    # math path, which materialises every score and was half of prefill time).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, num_heads, n, head_dim]
        k.transpose(0, 1)[None],  # [1, num_kv_heads, ctx, head_dim]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, num_heads, n, head_dim]
    return o[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    mask: torch.Tensor | None,  # [B, 1, 1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # Gather each sequence's blocks: [B, max_blocks, block_size, kv, d] -> [B, kv, L, d]
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    qg = q.view(b, num_kv_heads, group, head_dim)  # [B, kv, group, d]
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)
