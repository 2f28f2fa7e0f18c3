"""A prefixes-file entry once validated (`PrefixSpec`), its output contract, and the error that
lists everything wrong with a file. Plain data: the loader, index and registry build on it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import EngineError
from engine.core.sampling_params import GrammarSpec

MAX_NAME_LEN = 64
KINDS = ("chat", "text")
_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")

Messages = tuple[tuple[str, str], ...]


class RegistryFileError(EngineError):
    """Everything wrong with a prefixes file, as one error; message names file, entry, field."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"{path}: " + "; ".join(problems))
        self.path = path
        self.problems = list(problems)


@dataclass(frozen=True)
class PrefixContract:
    """What an entry declares for the requests that hit it; each field is a default that the
    request's own field overrides. `response_format` is the entry's format as JSON text (what
    the admin API shows); `grammar` is what it constrains (compiled when the file loads)."""

    response_format: str | None = None
    grammar: GrammarSpec | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PrefixSpec:
    """One validated entry of the prefixes file and the token ids the registry pins for it.

    For chat entries `token_ids` is the part of the rendering that every conversation
    continuing these messages starts with (see `render_chat_prefix`): system messages only,
    with the next user turn's opening; other entries, the messages rendered alone or a few
    tokens fewer (a last message closed differently when nothing follows it).
    """

    name: str
    description: str
    kind: str
    messages: Messages
    text: str
    token_ids: tuple[int, ...]
    contract: PrefixContract = PrefixContract()
    # API key names allowed to hit and see this entry; None: every tenant.
    tenants: tuple[str, ...] | None = None

    def visible_to(self, tenant: str | None) -> bool:
        return self.tenants is None or tenant in self.tenants

    def __post_init__(self) -> None:
        if not is_valid_name(self.name):
            raise ValueError(f"invalid prefix name {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "chat") != bool(self.messages) or (self.kind == "text") != bool(self.text):
            raise ValueError("a chat prefix has messages and no text, a text prefix the reverse")
        if not self.token_ids:
            raise ValueError("a prefix needs at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def is_valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME_LEN and _NAME_PATTERN.fullmatch(name) is not None
