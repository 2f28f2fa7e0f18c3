"""The KV cache's tensors: per layer, K and V `[num_blocks, block_size, num_kv_heads,
head_dim]`, owned by the executor (the block pool only counts and names blocks).

One allocation each for K and V; layer i uses views [i]. `torch.empty`: untouched pages of a
large CPU cache cost no RAM until written. Blocks never handed out still hold whatever
`torch.empty` gave, possibly NaN: attention masks unused slots, but a masked NaN value still
poisons softmax(scores) @ V (0 * NaN), so each block is zeroed before the first forward that
can use it (lazily, so RAM stays uncommitted). The pool hands fresh blocks out in id order,
so "every block below `num_touched`" is all that must be zeroed.
"""

from __future__ import annotations

import torch

from engine.kvcache.block_pool import KVCacheSpec


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        shape = (spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.k_cache = torch.empty(shape, dtype=spec.dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=spec.dtype, device=device)
        self.num_zeroed = 0

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache[layer], self.v_cache[layer]

    def zero_fresh(self, num_touched: int) -> None:
        """Zero blocks [already zeroed, num_touched): those handed out since the last call."""
        if num_touched > self.num_zeroed:
            self.k_cache[:, self.num_zeroed : num_touched].zero_()
            self.v_cache[:, self.num_zeroed : num_touched].zero_()
            self.num_zeroed = num_touched

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a partially shared block)."""
        self.k_cache[:, dst].copy_(self.k_cache[:, src])
        self.v_cache[:, dst].copy_(self.v_cache[:, src])
