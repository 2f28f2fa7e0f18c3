"""KVCache: the executor's K/V tensors in the paged layout; copies and lazy zeroing."""

from __future__ import annotations

import torch

from engine.executor.kv_cache import KVCache
from engine.kvcache.block_pool import BlockPool, KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def _cache() -> KVCache:
    return KVCache(SPEC, 8, torch.device("cpu"))


def test_tensors_have_the_paged_layout() -> None:
    k, v = _cache().layer_caches(1)
    assert k.shape == v.shape == (8, 4, 2, 4)  # [num_blocks, block_size, kv_heads, head_dim]


def test_copy_block_copies_every_layer() -> None:
    cache, (src, dst) = _cache(), BlockPool(SPEC, 8).allocate(2)
    cache.k_cache[:, src].fill_(3.0)
    cache.v_cache[:, src].fill_(4.0)
    cache.copy_block(src, dst)
    assert torch.equal(cache.k_cache[:, dst], cache.k_cache[:, src])
    assert torch.equal(cache.v_cache[:, dst], cache.v_cache[:, src])


def test_fresh_blocks_are_zeroed_so_masked_slots_cannot_poison_attention() -> None:
    cache, pool = _cache(), BlockPool(SPEC, 8)
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    first = pool.allocate(3)
    cache.zero_fresh(pool.num_touched)
    assert not cache.k_cache[:, first].isnan().any() and not cache.v_cache[:, first].isnan().any()
    assert cache.k_cache[:, 3:].isnan().all()  # untouched blocks stay uncommitted
    cache.k_cache[:, 0:3].fill_(1.0)  # written by a forward: a later call leaves them be
    cache.zero_fresh(pool.num_touched)
    assert cache.k_cache[:, first].eq(1.0).all()
