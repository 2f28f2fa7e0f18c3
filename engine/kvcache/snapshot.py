"""KV snapshots: a run of KV blocks (and, for a registered prefix, the logits after its last
token) in one file, written so that a crash never leaves a readable half, and read back into
the cache only when every byte checks.

A snapshot is only as good as the proof that it is the KV this engine would compute itself:
the same model files, weight format, dtypes, kernels and block shape (the `identity`, a
mapping of named facts compared one by one, so a mismatch is logged by name), and the same
token ids. Anything else is a `SnapshotError` and the caller recomputes.

Layout: MAGIC, the header's length (u32, little-endian), the header (UTF-8 JSON), the
header's CRC-32 (u32), then each block's K for every layer and its V for every layer (the
cache's dtype, `[num_layers, block_size, num_kv_heads, head_dim]` each), then the logits
(float32), if any. The header holds the identity, the caller's `meta` (token ids, hash
chains), the block count and a CRC-32 per block and of the logits. Blocks are read layer by
layer straight into the cache's tensors (each layer's part of a block is contiguous there):
disk bandwidth bounds a load, and no second copy of the snapshot is ever held in memory.

Writes go to a temporary file in the same directory, are fsynced and renamed over the target
(then the directory is fsynced): a reader sees the old file or the whole new one. A crash
mid-write leaves only a temporary, which `remove_stale_temporaries` deletes at the next start.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import secrets
import socket
import struct
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import torch

logger = logging.getLogger(__name__)

MAGIC = b"PGKVSNP1"
_U32 = struct.Struct("<I")
_TMP_PREFIX = ".tmp-"
_MAX_HEADER_BYTES = 64 << 20
_HOST = socket.gethostname().replace("-", "_")


class SnapshotError(Exception):
    """Why a snapshot cannot be used (the caller logs it and recomputes)."""


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    identity: dict[str, str]
    meta: dict[str, Any]
    num_blocks: int
    block_bytes: int
    block_crcs: list[int]
    logits_numel: int
    logits_crc: int
    data_offset: int

    def check(self, identity: Mapping[str, str], block_bytes: int) -> None:
        """Raise SnapshotError naming the first fact that differs from this engine's."""
        for name in sorted(set(identity) | set(self.identity)):
            mine, theirs = identity.get(name), self.identity.get(name)
            if mine != theirs:
                raise SnapshotError(f"made with {name} {theirs!r}, this engine has {mine!r}")
        if self.block_bytes != block_bytes:
            raise SnapshotError(f"blocks of {self.block_bytes} bytes, this cache's: {block_bytes}")


def block_bytes_of(k_cache: torch.Tensor) -> int:
    """Bytes of one block's K and V in every layer: `k_cache` is `[layers, blocks, ...]`."""
    return 2 * k_cache[:, 0].numel() * k_cache.element_size()


def write_snapshot(
    path: Path,
    identity: Mapping[str, str],
    meta: Mapping[str, Any],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: Sequence[int],
    logits: torch.Tensor | None = None,
) -> None:
    """Write `block_ids` of the caches (`[layers, blocks, ...]`, on the CPU; `gather_blocks`'
    copy when the cache itself may change meanwhile: the caller's to ensure) and `logits` to
    `path`, crash-safely. Straight from the cache's memory: no copy of the blocks is made."""
    crcs = [_crc(_block_chunks(k_cache, v_cache, b)) for b in block_ids]
    logits_raw = (
        logits.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy()
        if logits is not None
        else None
    )
    header = {
        "identity": dict(identity),
        "meta": dict(meta),
        "num_blocks": len(block_ids),
        "block_bytes": block_bytes_of(k_cache),
        "block_crcs": crcs,
        "logits_numel": 0 if logits is None else int(logits.numel()),
        "logits_crc": zlib.crc32(logits_raw.data) if logits_raw is not None else 0,
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The host and a random part too: replicas in containers or on other hosts sharing the
    # folder can have the same pid.
    tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{_HOST}-{secrets.token_hex(4)}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(_U32.pack(len(header_bytes)))
            f.write(header_bytes)
            f.write(_U32.pack(zlib.crc32(header_bytes)))
            for block_id in block_ids:
                for chunk in _block_chunks(k_cache, v_cache, block_id):
                    f.write(chunk.data)
            if logits_raw is not None:
                f.write(logits_raw.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _block_chunks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_id: int) -> list[Any]:
    """One block's bytes as the file holds them: K of each layer, then V of each layer, each a
    contiguous uint8 view of the cache (`[layers, blocks, ...]`), so the file's bytes go to and
    from the cache's own memory with no staging copy (and no multi-threaded strided copy,
    whose thread wake-ups cost milliseconds on a busy 2-core machine)."""
    return [
        cache[layer, block_id].view(-1).view(torch.uint8).numpy()
        for cache in (k_cache, v_cache)
        for layer in range(cache.shape[0])
    ]


def _crc(chunks: list[Any]) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk.data, crc)
    return crc


def read_header(path: Path) -> SnapshotHeader:
    """The header of the snapshot at `path`; SnapshotError if it is not one (or damaged)."""
    try:
        with open(path, "rb") as f:
            return _read_header(f, path.stat().st_size)
    except OSError as exc:
        raise SnapshotError(f"unreadable: {exc}") from exc


def read_blocks(
    path: Path,
    header: SnapshotHeader,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: Sequence[int],
    first: int = 0,
) -> torch.Tensor | None:
    """Read the snapshot's blocks `first`, `first + 1`, ... into `block_ids` of the caches
    (`[layers, blocks, ...]`, on the CPU) and return its logits (float32, CPU) or None. The
    file is memory-mapped, its header checked to be `header` still (another process may have
    renamed a new file over it), every checksum verified, then the blocks are copied into the
    cache in one pass: a snapshot that does not check (SnapshotError) writes nothing."""
    if first < 0 or first + len(block_ids) > header.num_blocks:
        raise SnapshotError(f"{header.num_blocks} blocks, {first}+{len(block_ids)} asked for")
    if block_bytes_of(k_cache) != header.block_bytes:
        raise SnapshotError(
            f"blocks of {header.block_bytes} bytes, this cache's: {block_bytes_of(k_cache)}"
        )
    try:
        with open(path, "rb") as f:
            # ACCESS_COPY: a writable view for torch, private, nothing copied unless written.
            # Not closed here: the views below hold it, and it unmaps when they go.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"unreadable: {exc}") from exc
    if _parse_header(bytes(mapped[: header.data_offset]), len(mapped)) != header:
        raise SnapshotError("it was replaced while it was read")
    data = numpy.frombuffer(mapped, numpy.uint8)
    size = header.block_bytes
    start = header.data_offset + first * size
    for i in range(first, first + len(block_ids)):  # all checked before any reaches the cache
        offset = header.data_offset + i * size
        if zlib.crc32(data[offset : offset + size].data) != header.block_crcs[i]:
            raise SnapshotError(f"block {i} of {header.num_blocks} fails its checksum")
    logits_raw = data[header.data_offset + header.num_blocks * size :]
    if header.logits_numel and zlib.crc32(logits_raw.data) != header.logits_crc:
        raise SnapshotError("its logits fail their checksum")
    layers, (block_size, heads, head_dim) = k_cache.shape[0], k_cache.shape[2:]
    blocks = torch.from_numpy(data[start : start + len(block_ids) * size]).view(k_cache.dtype)
    blocks = blocks.view(len(block_ids), 2, layers, block_size, heads, head_dim)
    index = torch.tensor(list(block_ids), dtype=torch.long)
    k_cache.index_copy_(1, index, blocks[:, 0].transpose(0, 1))
    v_cache.index_copy_(1, index, blocks[:, 1].transpose(0, 1))
    if not header.logits_numel:
        return None
    return torch.from_numpy(logits_raw.copy()).view(torch.float32)


def gather_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU copy of `block_ids`' K and V (`[layers, n, ...]` each, block i at index i), for
    `write_snapshot` on another thread: the blocks themselves may be reused meanwhile."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=k_cache.device)
    return k_cache.index_select(1, index).cpu(), v_cache.index_select(1, index).cpu()


def remove_stale_temporaries(directory: Path, max_age_s: float = 3600.0) -> int:
    """Delete temporaries left by writers that died: this host's whose pid is gone, and any
    older than `max_age_s` (a writer elsewhere, or a pid reused since). The count removed."""
    removed = 0
    if not directory.is_dir():
        return 0
    now = time.time()
    for tmp in directory.glob(f"{_TMP_PREFIX}*"):
        pid, _, rest = tmp.name.removeprefix(_TMP_PREFIX).partition("-")
        dead_here = rest.startswith(f"{_HOST}-") and pid.isdigit() and not _pid_alive(int(pid))
        try:
            if dead_here or now - tmp.stat().st_mtime > max_age_s:
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _read_header(f: BinaryIO, file_size: int) -> SnapshotHeader:
    head = f.read(len(MAGIC) + _U32.size)
    if len(head) == len(MAGIC) + _U32.size:
        (length,) = _U32.unpack(head[len(MAGIC) :])
        if length <= _MAX_HEADER_BYTES:
            head += f.read(length + _U32.size)
    return _parse_header(head, file_size)


def _parse_header(head: bytes, file_size: int) -> SnapshotHeader:
    """The header at the start of `head` (a file of `file_size` bytes), checked: its magic,
    its CRC, its fields, and the file's size against what it promises."""
    if head[: len(MAGIC)] != MAGIC:
        raise SnapshotError("not a KV snapshot (bad magic)")
    if len(head) < len(MAGIC) + _U32.size:
        raise SnapshotError("truncated in its header")
    (length,) = _U32.unpack_from(head, len(MAGIC))
    if length > _MAX_HEADER_BYTES:
        raise SnapshotError(f"a header of {length} bytes")
    begin = len(MAGIC) + _U32.size
    if len(head) < begin + length + _U32.size:
        raise SnapshotError("truncated in its header")
    header_bytes = head[begin : begin + length]
    (crc,) = _U32.unpack_from(head, begin + length)
    if zlib.crc32(header_bytes) != crc:
        raise SnapshotError("its header fails its checksum")
    try:
        fields = json.loads(header_bytes)
        header = SnapshotHeader(
            identity={str(k): str(v) for k, v in fields["identity"].items()},
            meta=dict(fields["meta"]),
            num_blocks=int(fields["num_blocks"]),
            block_bytes=int(fields["block_bytes"]),
            block_crcs=[int(c) for c in fields["block_crcs"]],
            logits_numel=int(fields["logits_numel"]),
            logits_crc=int(fields["logits_crc"]),
            data_offset=begin + length + _U32.size,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"a malformed header ({exc!r})") from exc
    if len(header.block_crcs) != header.num_blocks:
        raise SnapshotError("a header whose checksums do not match its block count")
    expected = header.data_offset + header.num_blocks * header.block_bytes + 4 * header.logits_numel
    if file_size != expected:
        raise SnapshotError(f"{file_size} bytes where its header promises {expected} (truncated?)")
    return header


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
