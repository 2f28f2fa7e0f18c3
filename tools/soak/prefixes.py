"""The prefixes file the soak edits: its entries, the valid, invalid and half-written files
it writes, drafted from a seeded generator so that a seed replays the same edits."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import yaml

VERSIONS = 3  # contents each prefix entry cycles through (load prompts use them all)
MAX_KEPT = 3  # registered entries a truncated edit keeps (it adds one: at most 4 in a file)
# Short sentences in words the test tokenizer knows: a few blocks each even at block size 4,
# so that old and new entries pinned together during a reload fit a small pool.
POOL_TEXTS = (
    "You are a helpful assistant.",
    "The scheduler admits new requests.",
    "Prefix caching shares the blocks.",
    "Answer the question briefly and politely.",
    "The model reads the prompt.",
    "Tokens are generated one at a time.",
)
FILE_HEADER = (
    "# written by the soak (tools/soak): edited and hot-reloaded while it runs\nversion: 1\n"
)
INVALID_VARIANTS = (
    "duplicate_name",
    "unknown_field",
    "both_bodies",
    "missing_body",
    "bad_name",
    "bad_role",
    "wrong_version",
    "yaml_syntax",
    "not_utf8",
    "empty_file",
    "too_long",
)


@dataclass(frozen=True)
class Entry:
    """One prefixes.yaml entry; `version` > 0 appends a marker, which changes its token ids
    (the registry must re-fill it) while its name stays."""

    name: str
    kind: Literal["text", "chat"]
    base: str
    version: int = 0

    @property
    def content(self) -> str:
        return self.base if self.version == 0 else f"{self.base} (v{self.version})"

    def at_version(self, version: int) -> Entry:
        return replace(self, version=version)

    def as_yaml(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"name": self.name, "text": self.content}
        return {"name": self.name, "messages": [{"role": "system", "content": self.content}]}


def entry_pool() -> list[Entry]:
    kinds: tuple[Literal["text", "chat"], ...] = ("chat", "text")
    return [Entry(f"soak-{i}", kinds[i % 2], text) for i, text in enumerate(POOL_TEXTS)]


def _dump(items: list[dict[str, Any]]) -> str:
    return yaml.safe_dump(items, sort_keys=False, allow_unicode=True, width=10_000)


def _file(items_yaml: str) -> str:
    return FILE_HEADER + "prefixes:\n" + items_yaml


def render_file(entries: Sequence[Entry]) -> str:
    if not entries:
        return FILE_HEADER + "prefixes: []\n"
    return _file("".join(_dump([e.as_yaml()]) for e in entries))


def split_file(entries: Sequence[Entry], cut: int) -> tuple[bytes, bytes]:
    """`render_file(entries)` in two parts cut before entry `cut`. Each entry is its own YAML
    list item, so the first part alone is a shorter file that is still valid."""
    blocks = [_dump([e.as_yaml()]) for e in entries]
    return _file("".join(blocks[:cut])).encode(), "".join(blocks[cut:]).encode()


def invalid_file(variant: str, keep: Sequence[Entry], extra: Entry, max_model_len: int) -> bytes:
    """A file the server must refuse. Besides the fault it holds a different, valid set of
    names (`keep` + `extra`), so a server that applied its valid part shows in the listing."""
    entries = [*keep, extra]
    items = [e.as_yaml() for e in entries]
    broken: dict[str, Any] | None = {
        "duplicate_name": items[0],
        "unknown_field": {"name": "soak-bad", "txt": "a typo of text"},
        "both_bodies": {
            "name": "soak-bad",
            "text": "x",
            "messages": [{"role": "user", "content": "x"}],
        },
        "missing_body": {"name": "soak-bad"},
        "bad_name": {"name": "bad name!", "text": "x"},
        "bad_role": {"name": "soak-bad", "messages": [{"role": "robot", "content": "x"}]},
        "too_long": {"name": "soak-bad", "text": "the quick fox " * max_model_len},
    }.get(variant)
    if broken is not None:
        return _file(_dump([*items, broken])).encode()
    if variant == "wrong_version":
        return render_file(entries).replace("version: 1", "version: 2").encode()
    if variant == "yaml_syntax":
        return (render_file(entries) + "  - name: [unclosed\n").encode()
    if variant == "not_utf8":
        return render_file(entries).encode() + b"- name: soak-bad\n  text: caf\xc3\x28\n"
    if variant == "empty_file":
        return b""
    raise ValueError(f"unknown invalid variant {variant!r}")


class Drafter:
    """Drafts each edit's content from `current`, the entries of the last valid file, with
    one seeded generator (the order of its draws is part of what a seed replays)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pool = entry_pool()

    def valid_set(self, current: Sequence[Entry]) -> list[Entry]:
        """2-3 pool entries, each registered one kept unchanged with odds 0.7; never
        `current` itself (an edit must change something)."""
        names = self.rng.sample([e.name for e in self.pool], self.rng.randint(2, 3))
        by_name = {e.name: e for e in current}
        entries = []
        for name in names:
            kept = by_name.get(name)
            if kept is not None and self.rng.random() < 0.7:
                entries.append(kept)
            else:
                entries.append(self._version_of(name, current))
        if entries == list(current):
            entries[-1] = self._version_of(entries[-1].name, current)
        return entries

    def invalid(self, current: Sequence[Entry], max_model_len: int) -> tuple[str, bytes]:
        """A fault, and a file with it beside a set of names other than `current`'s."""
        variant = self.rng.choice(INVALID_VARIANTS)
        keep = current[1:] if len(current) > 1 else current
        extra = self._fresh_entry(current, exclude={e.name for e in current})
        return variant, invalid_file(variant, keep, extra, max_model_len)

    def truncated_layout(self, current: Sequence[Entry]) -> tuple[list[Entry], int]:
        """The full file and where its first half ends. The half must differ from both the
        previous file and the full one, so that acting on it shows: with two or more entries
        registered it drops some of them (kept unchanged in the full file: their hit counts
        restart if they are dropped and re-created); otherwise it holds one of two new ones."""
        taken = {e.name for e in current}
        kept = list(current[:MAX_KEPT])  # bounded: the pool keeps names to add, blocks to pin
        if len(kept) >= 2:
            new = self._fresh_entry(current, taken)
            return [*kept, new], self.rng.randint(1, len(kept) - 1)
        first = self._fresh_entry(current, taken)
        second = self._fresh_entry(current, taken | {first.name})
        return [first, second, *kept], 1

    def _fresh_entry(self, current: Sequence[Entry], exclude: set[str]) -> Entry:
        name = self.rng.choice([e.name for e in self.pool if e.name not in exclude])
        return self._version_of(name, current)

    def _version_of(self, name: str, current: Sequence[Entry]) -> Entry:
        """`name` with content other than the registered one. Versions stay in 0..VERSIONS-1,
        the ones the load's prompts use, so that load requests hit registered entries."""
        base = next(e for e in self.pool if e.name == name)
        registered = {e.name: e.version for e in current}.get(name)
        versions = [v for v in range(VERSIONS) if v != registered]
        return base.at_version(self.rng.choice(versions))
