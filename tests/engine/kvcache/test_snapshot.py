"""The KV snapshot file: bit-exact round trips, and every kind of damage refused by name."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.kvcache import snapshot
from engine.kvcache.snapshot import (
    SnapshotError,
    block_bytes_of,
    gather_blocks,
    read_blocks,
    read_header,
    remove_stale_temporaries,
    write_snapshot,
)

IDENTITY = {"model": "m", "weights": "int4", "compute_dtype": "float32"}


def _caches(dtype: torch.dtype, num_blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, blocks, block_size, heads, head_dim] with every value distinct-ish."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, num_blocks, 4, 2, 8)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


def _write(path: Path, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    k, v = _caches(dtype)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    write_snapshot(path, IDENTITY, {"token_digest": "abc"}, k, v, [5, 1, 3], logits)
    return k, v, logits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_blocks_and_logits_come_back_bit_for_bit_into_other_block_ids(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    path = tmp_path / "p.kv"
    k, v, logits = _write(path, dtype)
    header = read_header(path)
    header.check(IDENTITY, block_bytes_of(k))
    assert header.meta == {"token_digest": "abc"} and header.num_blocks == 3
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    restored = read_blocks(path, header, k2, v2, [0, 6, 2])
    for src, dst in [(5, 0), (1, 6), (3, 2)]:
        assert torch.equal(k2[:, dst].view(torch.uint8), k[:, src].view(torch.uint8))
        assert torch.equal(v2[:, dst].view(torch.uint8), v[:, src].view(torch.uint8))
    untouched = [b for b in range(8) if b not in (0, 6, 2)]
    assert not k2[:, untouched].any() and not v2[:, untouched].any()
    assert restored is not None and torch.equal(restored, logits)
    assert not list(tmp_path.glob(".tmp-*"))  # the temporary was renamed


def test_each_identity_fact_that_differs_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.kv"
    k, _, _ = _write(path)
    header = read_header(path)
    with pytest.raises(SnapshotError, match="weights 'int4', this engine has 'int8'"):
        header.check({**IDENTITY, "weights": "int8"}, block_bytes_of(k))
    with pytest.raises(SnapshotError, match="kernels None, this engine has 'avx512'"):
        header.check({**IDENTITY, "kernels": "avx512"}, block_bytes_of(k))
    with pytest.raises(SnapshotError, match="blocks of"):
        header.check(IDENTITY, block_bytes_of(k) * 2)


def _damage(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_block_fails_that_block(tmp_path: Path) -> None:
    path = tmp_path / "p.kv"
    k, v, _ = _write(path)
    header = read_header(path)
    block = header.block_bytes
    _damage(path, 50 * 4 + block + 7)  # inside the second block (before the logits)
    header = read_header(path)  # sizes and header still check: only the block's bytes fail
    with pytest.raises(SnapshotError, match="block 1 of 3 fails its checksum"):
        read_blocks(path, header, torch.zeros_like(k), torch.zeros_like(v), [0, 1, 2])


def test_a_flipped_bit_in_the_logits_fails(tmp_path: Path) -> None:
    path = tmp_path / "p.kv"
    k, v, _ = _write(path)
    _damage(path, 9)
    with pytest.raises(SnapshotError, match="logits fail"):
        read_blocks(path, read_header(path), torch.zeros_like(k), torch.zeros_like(v), [0, 1, 2])


def test_a_damaged_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.kv"
    _write(path)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="header fails its checksum"):
        read_header(path)


@pytest.mark.parametrize("keep", [0, 5, 13, 100, -1])
def test_a_truncated_file_is_refused_wherever_it_was_cut(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "p.kv"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(SnapshotError):
        read_header(path)


def test_other_files_are_not_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "p.kv"
    path.write_bytes(b"GGUF" + os.urandom(100))
    with pytest.raises(SnapshotError, match="bad magic"):
        read_header(path)
    with pytest.raises(SnapshotError, match="unreadable"):
        read_header(tmp_path / "missing.kv")


def _write_forever(path: str) -> None:
    """A child that keeps rewriting a large snapshot until it is killed."""
    k = torch.zeros(8, 64, 16, 8, 64, dtype=torch.float16)  # 16 MiB a write
    while True:
        write_snapshot(Path(path), IDENTITY, {}, k, k, range(64))


def test_a_writer_killed_mid_write_leaves_the_old_file_or_none_and_a_removable_temporary(
    tmp_path: Path,
) -> None:
    target = tmp_path / "big.kv"
    child = multiprocessing.get_context("spawn").Process(target=_write_forever, args=(str(target),))
    child.start()
    assert child.pid is not None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # stop it where a temporary exists, then kill it
            os.kill(child.pid, signal.SIGSTOP)
            os.waitpid(child.pid, os.WUNTRACED)  # stopped for sure before the look
            if list(tmp_path.glob(".tmp-*")):
                break
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.002)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert list(tmp_path.glob(".tmp-*")), "the child was never caught mid-write"
    if target.exists():  # a completed earlier write: whole, never the torn one
        header = read_header(target)
        k = torch.empty(8, 64, 16, 8, 64, dtype=torch.float16)
        read_blocks(target, header, k, torch.empty_like(k), range(64))
    assert remove_stale_temporaries(tmp_path) == 1
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_live_writers_temporary_is_left_alone_and_an_old_one_of_elsewhere_removed(
    tmp_path: Path,
) -> None:
    live = tmp_path / f".tmp-{os.getpid()}-{snapshot._HOST}-00ff00ff-x.kv"
    live.write_bytes(b"partial")
    other_host = tmp_path / ".tmp-1-otherhost-00ff00ff-x.kv"  # pid 1 elsewhere: not ours to ask
    other_host.write_bytes(b"partial")
    assert remove_stale_temporaries(tmp_path) == 0 and live.exists() and other_host.exists()
    hour_ago = time.time() - 3601
    os.utime(other_host, (hour_ago, hour_ago))
    assert remove_stale_temporaries(tmp_path) == 1 and not other_host.exists()
    assert live.exists() and remove_stale_temporaries(tmp_path / "absent") == 0


def test_a_gathered_copy_writes_the_same_file_as_the_cache_itself(tmp_path: Path) -> None:
    k, v = _caches(torch.bfloat16)
    write_snapshot(tmp_path / "a.kv", IDENTITY, {}, k, v, [6, 2])
    gk, gv = gather_blocks(k, v, [6, 2])
    write_snapshot(tmp_path / "b.kv", IDENTITY, {}, gk, gv, [0, 1])
    assert (tmp_path / "a.kv").read_bytes() == (tmp_path / "b.kv").read_bytes()
