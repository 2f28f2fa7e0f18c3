"""One HTTP exchange as data: the request, fully decided before it is sent (so that a seed
replays it), and the outcome it got, judged. Sending is `client.py`'s job, judging
`checks.py`'s, tallying `results.py`'s."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tools.soak.config import Target

CHAT_PATH, TEXT_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class PlannedRequest:
    """One HTTP exchange, fully decided before it is sent."""

    kind: str  # chat | completion | hostile:<case> | probe | final | admin
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool = False
    cut_after: int | None = None  # streams: events read before the client leaves (0: at once)
    client_timeout_s: float | None = None  # non-streaming: the client gives up this early
    expect: int | None = None  # hostile: the one status it must get
    long: bool = False

    @property
    def tally_kind(self) -> str:
        """The key of the load's `by_kind` count: chat, chat-long, completion, hostile..."""
        return self.kind.split(":")[0] + ("-long" if self.long else "")


def post_json(
    kind: str, path: str, body: dict[str, Any], target: Target, **options: Any
) -> PlannedRequest:
    return PlannedRequest(
        kind, "POST", path, json.dumps(body).encode(), target.json_headers(), **options
    )


@dataclass
class Outcome:
    """What one exchange got. result: completed | cut | nonstream_cut | timed_out |
    transport_error. `problems` are invariant violations, already in words."""

    status: int | None = None
    result: str = "completed"
    stream_errors: int = 0
    stream_server_errors: int = 0
    non_openai_errors: int = 0
    bad_successes: int = 0
    broken_stream: bool = False
    problems: list[str] = field(default_factory=list)


Send = Callable[[PlannedRequest], Awaitable[Outcome]]  # sends and records one exchange
