"""The paged KV cache's bookkeeping: block hashes, the block pool, the cache manager."""
