"""Edits of the prefixes file while the load runs: which kind comes next, how each is written
(atomically, or in place in two halves as a careless editor does), and the settling after
each edit, whose registry state `checks` judges."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tools.soak.checks import POLL_S, check_half, check_state, judge_body
from tools.soak.config import EditKind, EditSettings, SoakError, Target
from tools.soak.exchange import Outcome, PlannedRequest, Send
from tools.soak.prefixes import Drafter, Entry, render_file, split_file
from tools.soak.results import SoakResult, record
from tools.soak.server import Listing
from tools.soak.traffic import probe_request


def edit_kinds(
    invalid_rate: float, truncated_rate: float, rng: random.Random
) -> Iterator[EditKind]:
    """The kinds of the edits, in order, without end. The first is valid (the soak then knows
    every entry the server holds), then one of each other kind with a rate > 0 in a seeded
    order, so that even a short run exercises them all; after that, drawn by the rates."""
    rates: dict[EditKind, float] = {"invalid": invalid_rate, "truncated": truncated_rate}
    others = [kind for kind, rate in rates.items() if rate > 0]
    rng.shuffle(others)
    yield from ["valid", *others]
    while True:
        x = rng.random()
        yield (
            "truncated"
            if x < truncated_rate
            else "invalid"
            if x < truncated_rate + invalid_rate
            else "valid"
        )


def edit_plan(settings: EditSettings, seed: int) -> Iterator[EditKind]:
    """The run's edit kinds: a generator of its own, so that they depend on the seed only."""
    rng = random.Random(f"{seed}:edit-kinds")
    return edit_kinds(settings.invalid_rate, settings.truncated_rate, rng)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file in one rename, with an mtime strictly newer than the old one (a 1 s
    step), so that a server polling the mtime never reads half of it and always sees it."""
    previous = path.stat().st_mtime_ns if path.exists() else 0
    mtime = max(time.time_ns(), previous + 1_000_000_000)
    tmp = path.with_name(path.name + ".soak-tmp")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(mtime, mtime))
    os.replace(tmp, path)


def write_in_halves(path: Path, first: bytes, second: bytes, pause_s: float) -> None:
    """Write the file in place, non-atomically, as a careless editor or `cat > file` does:
    truncate, the first half, a pause, the rest. Runs in a thread so that the pause is not
    stretched by a busy event loop (it must stay below the server's poll interval)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, 0o644)
    try:
        _write_all(fd, first)
        half_mtime = os.fstat(fd).st_mtime_ns
        time.sleep(pause_s)
        _write_all(fd, second)
    finally:
        os.close(fd)
    if path.stat().st_mtime_ns == half_mtime:  # a coarse-mtime file system: make it visible
        os.utime(path, ns=(half_mtime + 1_000_000_000,) * 2)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


class Editor:
    """Edits the prefixes file while the load runs and checks, after each edit settles, that
    the registry is the last valid file written (bounded waits throughout). `current`: the
    entries of the file the server started with (None: unknown, read from the listing)."""

    def __init__(
        self,
        settings: EditSettings,
        target: Target,
        admin: httpx.AsyncClient,
        send: Send,
        result: SoakResult,
        seed: int,
        current: list[Entry] | None,
    ) -> None:
        assert target.prefixes_file is not None
        self.settings, self.target, self.path = settings, target, target.prefixes_file
        self.admin, self.send, self.result, self.seed = admin, send, result, seed
        self.drafter = Drafter(random.Random(f"{seed}:edits"))
        self.current: list[Entry] = current or []  # the last valid file, as entries
        self.expected = None if current is None else [e.name for e in current]

    async def run(self, deadline: float, load_done: asyncio.Event) -> None:
        """Edit every interval until max_edits, the deadline, or (without max_edits) the end
        of the load."""
        if self.expected is None:
            self.expected = (await self._listing_or_fail()).names
        else:
            await self._check_initial()
        limit = self.settings.max_edits
        for kind in itertools.islice(edit_plan(self.settings, self.seed), limit):
            if not await self._wait_interval(deadline, load_done if limit is None else None):
                return
            await self.edit(kind)

    async def edit(self, kind: EditKind) -> None:
        """One edit of `kind`, written, settled and checked."""
        if kind == "valid":
            await self.valid()
        elif kind == "invalid":
            await self.invalid()
        else:
            await self.truncated()

    async def _wait_interval(self, deadline: float, stop: asyncio.Event | None) -> bool:
        delay = min(self.settings.interval_s, deadline - time.monotonic())
        if delay <= 0:
            return False
        if stop is None:
            await asyncio.sleep(delay)
            return time.monotonic() < deadline
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            return time.monotonic() < deadline
        return False

    async def valid(self) -> None:
        entries = self.drafter.valid_set(self.current)
        written = time.time()
        write_atomic(self.path, render_file(entries).encode())
        self._wrote("valid", entries)
        listing, _ = await self._settle(
            lambda s: (
                s.reloaded_since(written) and (s.reload_ok is False or s.names == self.expected)
            )
        )
        self._confirm_applied("valid", listing)

    async def invalid(self) -> None:
        variant, data = self.drafter.invalid(self.current, self.target.max_model_len)
        written = time.time()
        write_atomic(self.path, data)
        self.result.edits["invalid"].written += 1
        listing, _ = await self._settle(
            lambda s: s.reloaded_since(written) and s.reload_ok is False
        )
        refused = (
            listing is not None
            and listing.reloaded_since(written)
            and listing.reload_ok is False
            and bool(listing.reload_error)
        )
        if not refused:
            self.result.problem(f"invalid edit ({variant}) not refused: {listing}")
        if self._check_state(listing, f"invalid edit ({variant})") and refused:
            self.result.edits["invalid"].confirmed += 1

    async def truncated(self) -> None:
        full, cut = self.drafter.truncated_layout(self.current)
        half_names = [e.name for e in full[:cut]]
        hits_before = await self._arm([e for e in full[cut:] if e in self.current])
        first, second = split_file(full, cut)
        pause = self.settings.truncated_pause_s
        writer = asyncio.ensure_future(
            asyncio.to_thread(write_in_halves, self.path, first, second, pause)
        )
        saw_half = await self._watch_half(writer, half_names)
        written = time.time()
        self._wrote("truncated", full)
        listing, saw_half_later = await self._settle(
            lambda s: s.reloaded_since(written) and s.names == self.expected, half_names
        )
        check_half(self.result, half_names, saw_half or saw_half_later, listing, hits_before)
        self._confirm_applied("truncated", listing)

    def _confirm_applied(self, kind: EditKind, listing: Listing | None) -> None:
        """A state check; a valid or truncated edit is confirmed when the registry lists it
        and the last reload succeeded."""
        if self._check_state(listing, f"{kind} edit") and listing is not None and listing.reload_ok:
            self.result.edits[kind].confirmed += 1

    def _wrote(self, kind: EditKind, entries: list[Entry]) -> None:
        self.result.edits[kind].written += 1
        self.current = list(entries)
        self.expected = [e.name for e in entries]

    async def _check_initial(self) -> None:
        listing, _ = await self._settle(lambda s: s.names == self.expected and not s.pending)
        self._check_state(listing, "initial file")

    def _check_state(self, listing: Listing | None, what: str) -> bool:
        return check_state(self.result, listing, self.expected, what)

    async def _arm(self, sentinels: list[Entry]) -> dict[str, int]:
        """Hit every sentinel (an entry the half drops) once, so that a re-created one (hits
        back to 0) shows; the hit counts of those armed."""
        for entry in sentinels:
            await self.send(probe_request(entry, self.target))
        listing = await self._listing_or_fail()
        hits = {e.name: listing.hits.get(e.name, 0) for e in sentinels}
        self.result.sentinels_armed += sum(1 for h in hits.values() if h > 0)
        return {name: h for name, h in hits.items() if h > 0}

    async def _watch_half(self, writer: asyncio.Future[None], half_names: list[str]) -> bool:
        """Watch the listing while the file is half-written; True if it ever lists the half."""
        saw_half = False
        try:
            while not writer.done():
                listing = await self.listing()
                saw_half = saw_half or (listing is not None and listing.names == half_names)
                await asyncio.wait({writer}, timeout=POLL_S)
        finally:
            await writer
        return saw_half

    async def _settle(
        self, done: Callable[[Listing], bool], half_names: list[str] | None = None
    ) -> tuple[Listing | None, bool]:
        """Poll the listing until `done` or the settle timeout: the last listing read, and
        whether any listing on the way was `half_names`."""
        deadline = time.monotonic() + self.settings.settle_timeout_s
        listing, saw_half = None, False
        while True:
            listing = await self.listing() or listing
            if listing is not None:
                saw_half = saw_half or listing.names == half_names
                if done(listing):
                    return listing, saw_half
            if time.monotonic() >= deadline:
                return listing, saw_half
            await asyncio.sleep(POLL_S)

    async def listing(self) -> Listing | None:
        """GET /v1/prefixes with the admin key, judged and recorded like any exchange (a 5xx
        or a malformed error here fails the run too); None unless it answered 200."""
        req = PlannedRequest("admin", "GET", "/v1/prefixes", b"", self.target.headers(admin=True))
        try:
            response = await self.admin.get(req.path, headers=req.headers)
        except httpx.TransportError as exc:
            outcome = Outcome(result="transport_error", problems=[f"GET /v1/prefixes: {exc!r}"])
            record(self.result, req, outcome, is_load=False)
            return None
        outcome = Outcome(status=response.status_code)
        judge_body(req, response.status_code, response.content, outcome)
        record(self.result, req, outcome, is_load=False)
        return Listing.parse(response.json()) if response.status_code == 200 else None

    async def reload_pending(self) -> bool:
        listing = await self.listing()
        return listing is not None and listing.pending

    async def _listing_or_fail(self) -> Listing:
        listing = await self.listing()
        if listing is None:
            raise SoakError("GET /v1/prefixes did not answer 200 (is the admin key right?)")
        return listing
