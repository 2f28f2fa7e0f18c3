"""One whole soak: start the server (unless --url), the hostile sweep, load and edits
together, the audit of the idle server, the stop by PID."""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tools.soak.checks import wait_idle
from tools.soak.client import execute, http_client
from tools.soak.config import SoakConfig, Target, check_local_url
from tools.soak.edits import Editor, write_atomic
from tools.soak.exchange import Outcome, PlannedRequest, Send
from tools.soak.hostile import hostile_cases
from tools.soak.prefixes import Entry, entry_pool, render_file
from tools.soak.results import SoakResult, record
from tools.soak.server import connect, scrape, start_server
from tools.soak.traffic import final_request, run_load

PREEMPTIONS = "prefixgate_num_preemptions_total"


@dataclass
class Run:
    """One whole soak: its result and where things were."""

    result: SoakResult
    target_url: str
    server_pid: int | None = None
    server_log: str | None = None
    server_command: list[str] | None = None


def run(config: SoakConfig) -> Run:
    """Start a server (unless --url), soak it, stop it by PID, and return the result."""
    if config.url is not None:
        return _run_against(config, check_local_url(config.url))
    work_dir = config.work_dir or Path(tempfile.mkdtemp(prefix="prefixgate-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    prefixes_file = work_dir / "prefixes.yaml"
    initial = entry_pool()[:2]
    write_atomic(prefixes_file, render_file(initial).encode())
    api_key, admin_key = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    server = start_server(config.server, prefixes_file, api_key, admin_key, work_dir)
    try:
        target = connect(server.url, api_key, admin_key, prefixes_file)
        result = asyncio.run(soak(config, target, initial))
    finally:
        code = server.stop(config.server.stop_timeout_s)
    result.server_exit_code, result.server_was_killed = code, server.was_killed
    result.server_tracebacks = server.log_text().count("Traceback")
    return Run(result, server.url, server.process.pid, str(server.log_path), server.command)


def _run_against(config: SoakConfig, url: str) -> Run:
    """A server someone else runs: its prefixes file (if given) is restored at the end."""
    path = config.prefixes_file
    original = path.read_bytes() if path is not None and path.exists() else None
    target = connect(url, config.api_key, config.admin_api_key, path)
    try:
        result = asyncio.run(soak(config, target, None))
    finally:
        if path is not None and original is not None:
            write_atomic(path, original)
    return Run(result, url)


async def soak(config: SoakConfig, target: Target, initial: list[Entry] | None) -> SoakResult:
    """The hostile sweep, then load and edits together, then the audit of the idle server.
    `initial`: the entries of the prefixes file the server started with (None: unknown)."""
    result = SoakResult()
    started = time.monotonic()
    timeout_s = config.load.request_timeout_s
    async with http_client(target, timeout_s) as client, http_client(target, 30.0) as admin:
        before = await scrape(client)

        async def send(req: PlannedRequest) -> Outcome:
            outcome = await execute(client, req, timeout_s)
            record(result, req, outcome, is_load=False)
            return outcome

        if config.load.hostile_rate > 0:
            await sweep_hostile(send, target, result)
        editor = None
        if target.prefixes_file is not None and config.edits.interval_s > 0:
            editor = Editor(config.edits, target, admin, send, result, config.seed, initial)
        deadline = started + config.load.duration_s
        await load_and_edits(config, target, client, result, editor, deadline)
        pending = None if editor is None else editor.reload_pending
        result.kv = await wait_idle(client, pending, config.idle_timeout_s)
        result.final_request_status = (await send(final_request(target))).status
        after = await scrape(client)
    result.preemptions = int(after.get(PREEMPTIONS) - before.get(PREEMPTIONS))
    result.server_5xx = int(after.server_5xx - before.server_5xx)
    result.duration_s = round(time.monotonic() - started, 1)
    return result


async def sweep_hostile(send: Send, target: Target, result: SoakResult) -> None:
    """Every hostile case once, whatever the draws: the load then repeats some under load."""
    for case in hostile_cases(target):
        status = (await send(case)).status
        result.load.hostile_sweep[case.kind.removeprefix("hostile:")] = status


async def load_and_edits(
    config: SoakConfig,
    target: Target,
    client: httpx.AsyncClient,
    result: SoakResult,
    editor: Editor | None,
    deadline: float,
) -> None:
    """The load, and the edits beside it; both end by the deadline (edits without
    --max-edits end with the load)."""
    load_done = asyncio.Event()

    async def load_then_signal() -> None:
        try:
            await run_load(config, target, client, result, deadline)
        finally:
            load_done.set()

    async with asyncio.TaskGroup() as group:
        group.create_task(load_then_signal())
        if editor is not None:
            group.create_task(editor.run(deadline, load_done))
