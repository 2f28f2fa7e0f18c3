"""BlockPool: allocation order, reference counts, pinning, and the integrity checker itself."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.block_pool import BlockPool, KVCacheSpec, num_blocks_for


def _pool(num_blocks: int = 8) -> BlockPool:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    return BlockPool(spec, num_blocks)


def test_a_block_holds_every_layer_s_k_and_v() -> None:
    assert _pool().spec.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4


def test_allocate_free_and_reuse() -> None:
    pool = _pool()
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    assert pool.ref_cnt[:4] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 5
    pool.free(first)
    assert pool.num_free_blocks == 8
    # Blocks freed without content hashes go to the front of the free queue: reused first.
    assert pool.allocate(6) == [2, 1, 0, 3, 4, 5]
    pool.check_integrity()


def test_cached_free_blocks_are_evicted_last_and_forget_their_hashes() -> None:
    pool = _pool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, b"hash-a")
    pool.cache_block(b, b"hash-b")
    pool.cache_block(b, b"hash-b-other-scope")  # one block, two scopes' hashes
    pool.free([b, a, c, d])  # b and a go to the back (LRU: b first), c and d to the front
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.cached_block(b"hash-a") == a
    assert pool.allocate(2) == [d, c]  # uncached blocks first: nothing cached is lost
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [b]  # then the least recently freed cached block
    assert pool.num_evictions == 1
    assert pool.cached_block(b"hash-b") is None and pool.cached_block(b"hash-b-other-scope") is None
    assert pool.cached_block(b"hash-a") == a
    pool.check_integrity()


def test_a_cached_free_block_can_be_shared_again() -> None:
    pool = _pool(2)
    [block] = pool.allocate(1)
    pool.cache_block(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.share([block])  # a later prompt hits it: it leaves the free queue
    assert pool.ref_cnt[block] == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) != [block]
    pool.check_integrity()
    pool.cache_block(block, b"h")  # indexing the same content again changes nothing
    assert pool.num_cached_blocks == 1


def test_an_uncached_free_block_cannot_be_shared() -> None:
    pool = _pool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="sharing free uncached block"):
        pool.share([block])


def test_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = _pool()
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_cnt[b] for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free_blocks == 6
    pool.free(blocks)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_pinned_blocks_stay_referenced_until_unpinned_and_freed() -> None:
    pool = _pool()
    blocks = pool.allocate(2)
    pool.pin(blocks)
    pool.share(blocks)  # a request borrows the prefix
    pool.free(blocks)  # ... and finishes
    assert pool.num_pinned_blocks == 2 and pool.num_free_blocks == 6
    pool.unpin(blocks)
    pool.free(blocks)
    assert pool.num_pinned_blocks == 0 and pool.num_free_blocks == 8
    pool.check_integrity()


def test_exhaustion_and_double_free_are_caught() -> None:
    pool = _pool(2)
    assert not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_integrity_check_detects_corruption() -> None:
    pool = _pool()
    pool.allocate(1)
    pool.ref_cnt[0] = 0  # referenced count lost but block not on the free list
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_num_blocks_for(tokens: int, blocks: int) -> None:
    assert num_blocks_for(tokens, 4) == blocks


def test_fresh_blocks_are_handed_out_in_id_order_up_to_a_high_water_mark() -> None:
    """The executor zeroes the K/V of every block below `num_touched` before a forward."""
    pool = _pool()
    assert pool.num_touched == 0
    first = pool.allocate(3)
    assert pool.num_touched == 3
    pool.free(first)
    pool.allocate(2)  # reused blocks: nothing new touched
    assert pool.num_touched == 3
    pool.allocate(4)
    assert pool.num_touched == 6
