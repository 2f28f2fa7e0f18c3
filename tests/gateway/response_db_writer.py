"""A process that writes responses into a SQLite store, for test_response_db's test of
several servers sharing one file. Its own module, so that a spawned child imports only this
and the store (not the engine and torch, as the test module would make it)."""

from __future__ import annotations

import asyncio
from multiprocessing.synchronize import Barrier
from pathlib import Path

from gateway.response_db import SqliteResponseStore


def write_responses(path: str, name: str, num_responses: int, start: Barrier) -> None:
    """Open the store once every writer is ready, then store `num_responses` responses owned
    by `name` (`<name>-<i>`), each read back at once."""
    start.wait()
    asyncio.run(_write(Path(path), name, num_responses))


async def _write(path: Path, name: str, num_responses: int) -> None:
    store = SqliteResponseStore(path, 10 * num_responses, 1 << 30, 3600.0)
    try:
        for i in range(num_responses):
            response_id = f"{name}-{i}"
            conversation = [{"role": "user", "content": f"turn {i} of {name}"}]
            assert await store.put({"id": response_id}, conversation, name)
            assert await store.get(response_id) is not None
    finally:
        await store.close()
