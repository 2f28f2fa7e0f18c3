"""KVSnapshots: the engine's KV kept on disk across restarts, crashes and replica replacements.

A registered prefix is written once it is filled and read back at the next start (or reload)
instead of prefilled, so a restart serves its first registry hit after a disk read rather
than a prefill. The file format and its checks are engine/kvcache/snapshot.py's; this binds
them to one engine: its pool, its KV tensors and the identity of what computes its KV.

The identity (`LoadedModel.kv_identity`) names everything that decides the KV's bits: the
model files and config, the context length, the weight format, the compute and KV dtypes, the
kernel build, the block shape, torch's and transformers' versions, the thread count and the
numeric code. A snapshot made under any other value is not used, and the
log line says which fact differed. Snapshots live under one folder per model
(`<dir>/<model>-<digest of its files>/`), so two models sharing a cache directory never
overwrite each other's; replicas of one model on one host share theirs.

Writes run on one background thread, so a fill never waits on the disk; the K/V are copied
out of the cache first (the blocks may be released and reused while the write runs).
Nothing here can fail a start: an unusable snapshot is a warning and a prefill, a failed
write a warning.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from engine.core.unused_files import mark_used, remove_if_unused
from engine.executor.kv_cache import KVCache
from engine.kvcache.block_pool import BlockPool, num_blocks_for
from engine.kvcache.snapshot import (
    SnapshotError,
    SnapshotHeader,
    block_bytes_of,
    gather_blocks,
    read_blocks,
    read_header,
    remove_stale_temporaries,
    write_snapshot,
)
from engine.registry.spec import PrefixSpec

logger = logging.getLogger(__name__)

_Job = Callable[[], None]


def snapshot_folder(root: Path, identity: Mapping[str, str]) -> Path:
    """Where one model's snapshots live: named by the model and its files' digest."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", identity.get("model", "model"))[:64]
    return root / f"{name}-{identity.get('model_files', 'unknown')[:12]}"


def _token_digest(token_ids: tuple[int, ...]) -> str:
    return hashlib.sha256(repr(token_ids).encode()).hexdigest()[:32]


class KVSnapshots:
    """Engine-thread API (`restore`, `save`) over one background writer thread."""

    def __init__(
        self, root: Path, identity: Mapping[str, str], pool: BlockPool, kv_cache: KVCache
    ) -> None:
        self.identity = dict(identity)
        self.folder = snapshot_folder(root, identity)
        self.pool = pool
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes_of(kv_cache.k_cache)
        self.num_restored = 0
        self.num_written = 0
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-snapshots", daemon=True)
        self._writer.start()
        try:
            removed = remove_stale_temporaries(self.folder)
            removed += remove_stale_temporaries(self.folder / "registry")
        except OSError as exc:
            logger.warning("KV snapshots: cannot list %s: %s", self.folder, exc)
        else:
            if removed:
                logger.info("KV snapshots: removed %d partial writes of dead processes", removed)

    def prefix_path(self, name: str) -> Path:
        """A registry entry's snapshot (its name may hold any character: kept readable and
        made unique by a digest)."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:64]
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        return self.folder / "registry" / f"{safe}-{digest}.kv"

    # -- registered prefixes (the loader's PrefixSnapshots) ----------------------------------------
    def restore(self, spec: PrefixSpec) -> tuple[list[int], torch.Tensor] | None:
        path = self.prefix_path(spec.name)
        start = time.perf_counter()
        try:
            restored = self._restore(spec, path)
        except Exception as exc:  # nothing here may fail a start or a reload: prefill instead
            logger.warning(
                "prefix %r: KV snapshot %s not used (%s): prefilling", spec.name, path, exc
            )
            return None
        if restored is None:
            return None
        mark_used(path)  # for `prune`
        self.num_restored += 1
        block_ids = restored[0]
        logger.info(
            "prefix %r: %d tokens restored from its KV snapshot (%.1f MB in %.0f ms)",
            spec.name,
            len(spec.token_ids),
            len(block_ids) * self.block_bytes / 1e6,
            (time.perf_counter() - start) * 1e3,
        )
        return restored

    def _restore(self, spec: PrefixSpec, path: Path) -> tuple[list[int], torch.Tensor] | None:
        if not path.is_file():
            logger.info("prefix %r: no KV snapshot yet, prefilling", spec.name)
            return None
        header = read_header(path)
        header.check(self.identity, self.block_bytes)
        if header.meta.get("token_digest") != _token_digest(spec.token_ids):
            logger.info("prefix %r: the entry changed since its KV snapshot, prefilling", spec.name)
            return None
        if header.num_blocks != num_blocks_for(len(spec.token_ids), self.pool.block_size):
            raise SnapshotError(f"{header.num_blocks} blocks for {len(spec.token_ids)} tokens")
        if not self.pool.can_allocate(header.num_blocks):
            raise SnapshotError(f"no {header.num_blocks} free blocks to read it into")
        if not header.logits_numel:
            raise SnapshotError("it holds no logits")
        block_ids, logits = self._read(path, header, 0, header.num_blocks)
        assert logits is not None
        return block_ids, logits.to(self.kv_cache.k_cache.device)

    def _read(
        self, path: Path, header: SnapshotHeader, first: int, count: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """Blocks [first, first + count) of the snapshot into fresh blocks (one reference
        each) and its logits, or nothing taken (the error raised)."""
        block_ids = self.pool.allocate(count)
        try:
            self.kv_cache.zero_fresh(self.pool.num_touched)  # before the blocks are written
            logits = read_blocks(
                path, header, self.kv_cache.k_cache, self.kv_cache.v_cache, block_ids, first
            )
        except BaseException:
            self.pool.free(block_ids)  # a failed read writes nothing to them
            raise
        return block_ids, logits

    def save(self, spec: PrefixSpec, block_ids: list[int], logits: torch.Tensor) -> None:
        try:
            k, v = gather_blocks(self.kv_cache.k_cache, self.kv_cache.v_cache, block_ids)
            logits = logits.detach().to("cpu", torch.float32, copy=True)
        except Exception as exc:  # a snapshot is a convenience: the fill itself stands
            logger.warning("prefix %r: no KV snapshot written (%s)", spec.name, exc)
            return
        path = self.prefix_path(spec.name)
        meta = {
            "kind": "prefix",
            "name": spec.name,
            "num_tokens": len(spec.token_ids),
            "token_digest": _token_digest(spec.token_ids),
        }
        self._jobs.put(lambda: self._write(path, meta, k, v, logits, range(k.shape[1])))

    def prune(self, names: Iterable[str]) -> None:
        """After a (re)load of the entries `names`: the registry snapshots of entries it does
        not name (removed, renamed) go if unused for a week (engine/core/unused_files.py; a
        loaded entry's stays however old), on the writer thread after the queued writes."""
        keep = {self.prefix_path(name) for name in names}
        self._jobs.put(lambda: self._prune(keep))

    def _prune(self, keep: set[Path]) -> None:
        folder = self.folder / "registry"
        for path in sorted(folder.glob("*.kv")) if folder.is_dir() else ():
            if path not in keep:
                remove_if_unused(path)

    # -- the hot automatic-cache set ---------------------------------------------------------------
    @property
    def hot_path(self) -> Path:
        return self.folder / "hot.kv"

    def save_hot(self, budget_bytes: int) -> None:
        """At a graceful shutdown, on the engine thread with nothing running: the most
        recently used cached blocks (not the registry's: they have their own snapshots), up
        to `budget_bytes`, with the hashes that make each findable in its own scope only.
        Written straight from the cache (no step will change it again). With nothing to
        keep, the last hot set is removed: it no longer says what was hot."""
        try:
            blocks = self.pool.cached_by_recency()[: budget_bytes // self.block_bytes]
            if not blocks:
                self.hot_path.unlink(missing_ok=True)
                return
            blocks.reverse()  # least recent first: restored in that order, the LRU order kept
            meta = {"kind": "hot", "hashes": [[h.hex() for h in hs] for _, hs in blocks]}
            block_ids = [b for b, _ in blocks]
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
            self._write(self.hot_path, meta, k, v, None, block_ids)
        except Exception as exc:  # a stop must finish: the queued registry writes come next
            logger.warning("the hot KV snapshot was not written (%s)", exc)

    def restore_hot(self) -> int:
        """At start, after the registry: the last shutdown's hot set, as free cached blocks
        findable by their hashes (evicted like any other when the pool needs them); its most
        recent blocks only when the pool has no room for all. The number of blocks restored;
        nothing when the file is absent or unusable (logged)."""
        path = self.hot_path
        start = time.perf_counter()
        try:
            if not path.is_file():
                return 0
            header = read_header(path)
            header.check(self.identity, self.block_bytes)
            hashes = [[bytes.fromhex(h) for h in block] for block in header.meta["hashes"]]
            if len(hashes) != header.num_blocks:
                raise SnapshotError("a hash list per block expected")
            count = min(header.num_blocks, self.pool.num_free_blocks)
            first = header.num_blocks - count  # the file holds the least recent first
            block_ids, _ = self._read(path, header, first, count)
        except Exception as exc:  # nothing here may fail a start: the cache starts empty
            logger.warning("the hot KV snapshot %s is not used (%s)", path, exc)
            return 0
        for block_id, block_hashes in zip(block_ids, hashes[first:], strict=True):
            for block_hash in block_hashes:
                self.pool.cache_block(block_id, block_hash)
        self.pool.free(block_ids)  # least recent first: the most recent end up last evicted
        logger.info(
            "automatic prefix cache: %d blocks restored from the hot snapshot (%.1f MB in %.0f ms)",
            len(block_ids),
            len(block_ids) * self.block_bytes / 1e6,
            (time.perf_counter() - start) * 1e3,
        )
        return len(block_ids)

    # -- the writer thread -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued write (tests, shutdown); False if `timeout` ran out."""
        done = threading.Event()
        self._jobs.put(done.set)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (at most `timeout` seconds), then stop the writer."""
        if self._writer.is_alive():
            self.flush(timeout)
            self._jobs.put(None)
            self._writer.join(timeout)

    def _write(
        self,
        path: Path,
        meta: Mapping[str, object],
        k: torch.Tensor,
        v: torch.Tensor,
        logits: torch.Tensor | None,
        block_ids: Sequence[int],
    ) -> None:
        start = time.perf_counter()
        try:
            write_snapshot(path, self.identity, meta, k, v, block_ids, logits)
        except Exception as exc:  # the disk full, the folder gone: the engine serves on
            logger.warning("KV snapshot %s not written: %s", path, exc)
            return
        self.num_written += 1
        logger.info(
            "KV snapshot %s written (%.1f MB in %.0f ms)",
            path,
            path.stat().st_size / 1e6,
            (time.perf_counter() - start) * 1e3,
        )

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a writer that dies would leave every later save queued forever
                logger.exception("KV snapshot write failed")
