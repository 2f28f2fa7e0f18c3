"""Content addresses of KV blocks, for automatic prefix caching.

A full block's hash covers its own tokens, the hash of the block before it (so it stands for
the whole prefix up to its end: two prompts share a block only if they agree on every token
before it) and, through the first block, the cache scope it was computed in. A scope
isolates tenants: a prompt can only hit blocks that were hashed in its own scope, so nobody
learns from `cached_tokens` or latency what another tenant sent (vLLM's `cache_salt`,
CVE-2025-46570).

blake2b with a 128-bit digest: fast, and collisions cannot be crafted to read another
prompt's KV (Python's `hash()` of token tuples could be).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
DIGEST_SIZE = 16


def scope_seed(*parts: str | None) -> BlockHash:
    """The parent hash of a scope's first block: one per (tenant, cache_salt, ...)."""
    text = "\0".join("" if part is None else part for part in parts)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE, person=b"pg-scope").digest()


def registry_seed(tenant: str | None = None) -> BlockHash:
    """The registry's scopes: one for entries every tenant may hit, one per tenant for the
    entries that name it (`tenants:`): nobody reaches an entry's blocks without the right."""
    return scope_seed("registry", tenant) if tenant is not None else scope_seed("registry")


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    seed: BlockHash,
) -> None:
    """Append to `hashes` the hash of every full block within the first `num_tokens` of
    `token_ids` that it does not have yet (blocks are hashed once, as they fill)."""
    parent = hashes[-1] if hashes else seed
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_SIZE).digest()
        hashes.append(parent)


# Registry entries are filed by hashes in the shared registry scope, whoever may see them (a
# lookup filters by visibility); a tenant's entries are also findable in its own scope.
REGISTRY_SEED = registry_seed()


def registry_hashes(
    token_ids: Sequence[int], block_size: int, seed: BlockHash = REGISTRY_SEED
) -> list[BlockHash]:
    """The hashes of every full block of `token_ids` in a registry scope."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, len(token_ids), block_size, seed)
    return hashes
