"""The soak's settings (frozen dataclasses, one field per command-line flag) and the target
it talks to. Plain data: every other module of the soak may import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
LOCAL_HOSTNAMES = frozenset({"127.0.0.1", "localhost"})

EditKind = Literal["valid", "invalid", "truncated"]
EDIT_KINDS: tuple[EditKind, ...] = ("valid", "invalid", "truncated")


@dataclass(frozen=True)
class ServerSettings:
    """The server the soak starts itself. The pool is small on purpose: two long requests
    must not fit in it together, so the scheduler has to preempt."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    block_size: int = 16
    num_kv_blocks: int = 48
    max_model_len: int = 512
    max_num_seqs: int = 8
    extra_args: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 45.0  # above the server's default --shutdown-grace of 30 s


@dataclass(frozen=True)
class LoadSettings:
    """The traffic. Rates are fractions of requests (0..1)."""

    duration_s: float = 180.0
    max_requests: int = 2000
    concurrency: int = 6
    disconnect_rate: float = 0.2
    long_rate: float = 0.25
    hostile_rate: float = 0.1
    stream_rate: float = 0.6
    short_max_tokens: int = 16
    long_max_tokens: int | None = None  # None: see traffic.long_max_tokens()
    request_timeout_s: float = 300.0


@dataclass(frozen=True)
class EditSettings:
    """Edits of the prefixes file while the load runs. interval 0 disables them."""

    interval_s: float = 5.0
    max_edits: int | None = None  # None: until the load ends; else this many (within duration)
    invalid_rate: float = 0.2
    truncated_rate: float = 0.2
    truncated_pause_s: float = 0.5
    settle_timeout_s: float = 60.0


@dataclass(frozen=True)
class SoakConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    load: LoadSettings = field(default_factory=LoadSettings)
    edits: EditSettings = field(default_factory=EditSettings)
    url: str | None = None  # a running server (127.0.0.1/localhost); None: start one
    prefixes_file: Path | None = None  # with url: the file that server watches
    api_key: str | None = None  # with url: its keys; a started server gets random ones
    admin_api_key: str | None = None
    seed: int = 0
    work_dir: Path | None = None  # server log and prefixes file; None: a new temp dir
    idle_timeout_s: float = 120.0
    command: str = "python -m tools.soak"


@dataclass(frozen=True)
class Target:
    """The server under test, as the soak talks to it."""

    url: str
    model: str
    max_model_len: int
    api_key: str | None
    admin_api_key: str | None
    prefixes_file: Path | None

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_api_key if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def json_headers(self) -> dict[str, str]:
        return {**self.headers(), "Content-Type": "application/json"}


class SoakError(Exception):
    """The soak cannot run (server did not start, wrong key, bad target)."""


def check_local_url(url: str) -> str:
    """The URL without a trailing slash; ValueError unless it is http(s) on 127.0.0.1 or
    localhost: the soak sends hostile traffic and rewrites files, never to another host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOCAL_HOSTNAMES:
        raise ValueError(f"refusing {url!r}: only http://127.0.0.1 or http://localhost URLs")
    return url.rstrip("/")
