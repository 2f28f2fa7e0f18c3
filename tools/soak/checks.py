"""The judgments: is a body or stream event OpenAI-shaped, does the registry list what the
last valid file holds, did the server leak KV blocks once idle. Problems go into the result
in words; `SoakResult.failures()` turns the counts into the verdict."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tools.soak.exchange import Outcome, PlannedRequest
from tools.soak.results import KvState, SoakResult
from tools.soak.server import Listing, scrape

ERROR_KEYS = frozenset({"message", "type", "param", "code"})
POLL_S = 0.1  # how often settle/idle loops look again


def openai_error_problem(payload: Any) -> str | None:
    """None if `payload` is exactly {"error": {"message", "type", "param", "code"}} with a
    string message and type; else what is wrong with it."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return f"not {{'error': ...}}: {str(payload)[:200]}"
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"error keys {sorted(error) if isinstance(error, dict) else type(error).__name__}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return "message/type not strings"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return "param/code neither null nor strings"
    return None


def judge_body(req: PlannedRequest, status: int, content: bytes, outcome: Outcome) -> None:
    """An error must be OpenAI-shaped; a 200 from a completions route an OpenAI object."""
    try:
        payload = json.loads(content)
    except ValueError:
        payload = content[:200]
    if status >= 400:
        if (problem := openai_error_problem(payload)) is not None:
            outcome.non_openai_errors += 1
            outcome.problems.append(f"{req.kind} {status}: {problem}")
    elif status == 200 and req.path.startswith(("/v1/chat/", "/v1/completions")):
        expected = "chat.completion" if "chat" in req.path else "text_completion"
        if not (
            isinstance(payload, dict)
            and payload.get("object") == expected
            and isinstance(payload.get("choices"), list)
        ):
            outcome.bad_successes += 1
            outcome.problems.append(
                f"{req.kind} 200 body is not a {expected}: {str(payload)[:200]}"
            )


def judge_chunk(req: PlannedRequest, payload: str, outcome: Outcome) -> None:
    """A stream event is a chunk with `choices` or an OpenAI-shaped error (never a
    server_error)."""
    try:
        chunk = json.loads(payload)
    except ValueError:
        outcome.bad_successes += 1
        outcome.problems.append(f"{req.kind}: stream event is not JSON: {payload[:200]}")
        return
    if isinstance(chunk, dict) and "error" in chunk:
        outcome.stream_errors += 1
        if (problem := openai_error_problem(chunk)) is not None:
            outcome.non_openai_errors += 1
            outcome.problems.append(f"{req.kind} stream error event: {problem}")
        elif chunk["error"]["type"] == "server_error":
            outcome.stream_server_errors += 1
            outcome.problems.append(f"{req.kind} stream server_error: {chunk['error']['message']}")
    elif not (isinstance(chunk, dict) and isinstance(chunk.get("choices"), list)):
        outcome.bad_successes += 1
        outcome.problems.append(f"{req.kind}: stream chunk without choices: {payload[:200]}")


def check_state(
    result: SoakResult, listing: Listing | None, expected: list[str] | None, what: str
) -> bool:
    """One state check: the registry lists exactly the last valid file's names."""
    result.state_checks += 1
    if listing is not None and listing.names == expected:
        return True
    result.lost_states += 1
    got = None if listing is None else listing.names
    error = None if listing is None else listing.reload_error
    result.problem(f"after {what}: listed {got}, expected {expected} (last reload error: {error})")
    return False


def check_half(
    result: SoakResult,
    half: list[str],
    listed: bool,
    listing: Listing | None,
    hits_before: dict[str, int],
) -> None:
    """One state check: the server never acted on the half of a truncated file, neither
    listing its names (`listed`) nor dropping and re-creating the entries after the cut (an
    entry re-created restarts from zero hits)."""
    reset = [] if listing is None else hits_reset(listing, hits_before)
    result.state_checks += 1
    if listed or reset:
        result.lost_states += 1
        result.half_file_seen += 1
        result.problem(
            f"truncated edit: the server acted on the half-written file (listed the "
            f"half's names {half}: {listed}; hit counts restarted: {reset})"
        )


def hits_reset(listing: Listing, before: dict[str, int]) -> list[str]:
    return [n for n, h in before.items() if n in listing.hits and listing.hits[n] < h]


async def wait_idle(
    client: httpx.AsyncClient,
    reload_pending: Callable[[], Awaitable[bool]] | None,
    timeout_s: float,
) -> KvState:
    """Poll /metrics until nothing runs or waits, no reload is pending and no block is held
    by a request (or the bound); a cut client is noticed by the server a moment after it
    left, so a leak counts only once the bound is reached."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = (await scrape(client)).kv()
        pending = reload_pending is not None and await reload_pending()
        kv.idle = kv.running == 0 and kv.waiting == 0 and not pending
        if (kv.idle and kv.leaked == 0) or time.monotonic() >= deadline:
            return kv
        await asyncio.sleep(POLL_S * 2)
