"""What a soak counted, and `failures()`: the invariants the run broke, in words. Every
exchange (load, probes, admin calls) is folded in by `record`, so that a 5xx or a malformed
error anywhere fails the run."""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.soak.config import EDIT_KINDS
from tools.soak.exchange import Outcome, PlannedRequest

MAX_PROBLEMS = 50  # problem samples kept in the report


@dataclass
class LoadTally:
    """What the requests got. `requests_sent` counts the load only; probes and admin calls
    are in `other_by_status`, and every exchange counts toward the error checks."""

    requests_sent: int = 0
    # dicts, not Counters: dataclasses.asdict would rebuild a Counter from its items.
    by_status: dict[str, int] = field(default_factory=dict)  # "none": no response
    by_kind: dict[str, int] = field(default_factory=dict)
    other_by_status: dict[str, int] = field(default_factory=dict)
    streams_completed: int = 0
    streams_cut: int = 0
    streams_broken: int = 0  # ended without [DONE] although the client did not cut it
    nonstream_completed: int = 0  # a planned client timeout the server answered first
    nonstream_cut: int = 0  # the client timed out early on purpose
    hostile_sent: int = 0  # the sweep (every case once) and the load's share
    hostile_unexpected: int = 0  # a hostile body got another status than its own
    hostile_sweep: dict[str, int | None] = field(default_factory=dict)  # case -> status
    client_5xx: int = 0
    stream_server_errors: int = 0  # `server_error` events inside 200 streams
    stream_errors: int = 0  # any error event inside a stream
    non_openai_errors: int = 0
    bad_successes: int = 0  # 200 bodies/chunks that are not OpenAI objects
    transport_errors: int = 0
    timed_out: int = 0  # still unfinished after --request-timeout

    @property
    def disconnects(self) -> int:
        return self.streams_cut + self.nonstream_cut


@dataclass
class EditTally:
    """`confirmed`: valid/truncated edits the server applied; invalid ones it refused while
    keeping the previous registry."""

    written: int = 0
    confirmed: int = 0


@dataclass
class KvState:
    total: int = 0
    free: int = 0
    pinned: int = 0
    running: int = 0
    waiting: int = 0
    idle: bool = False  # running == waiting == 0 and no reload pending within the bound

    @property
    def leaked(self) -> int:
        return self.total - self.free - self.pinned


@dataclass
class SoakResult:
    load: LoadTally = field(default_factory=LoadTally)
    edits: dict[str, EditTally] = field(
        default_factory=lambda: {k: EditTally() for k in EDIT_KINDS}
    )
    state_checks: int = 0
    lost_states: int = 0
    half_file_seen: int = 0  # truncated edits the server acted on half-written
    sentinels_armed: int = 0  # entries a truncated edit watched by their hit counts
    preemptions: int = 0
    server_5xx: int = 0  # from the server's prefixgate_requests_total
    kv: KvState = field(default_factory=KvState)
    final_request_status: int | None = None
    duration_s: float = 0.0
    server_exit_code: int | None = None
    server_was_killed: bool = False
    server_tracebacks: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def failures(self) -> list[str]:
        """Every invariant the run broke, in words; empty means the soak passed."""
        load = self.load
        counts = {
            "5xx responses": load.client_5xx,
            "5xx recorded by the server": self.server_5xx,
            "server_error events in streams": load.stream_server_errors,
            "errors not OpenAI-shaped": load.non_openai_errors,
            "200 bodies not OpenAI-shaped": load.bad_successes,
            "streams ended without [DONE]": load.streams_broken,
            "hostile bodies with an unexpected status": load.hostile_unexpected,
            "transport errors": load.transport_errors,
            "requests unfinished at --request-timeout": load.timed_out,
            "leaked KV blocks": self.kv.leaked,
            "lost registry states": self.lost_states,
        }
        checks = [f"{name}: {value}" for name, value in counts.items() if value]
        if not self.kv.idle:
            checks.append("the server did not go idle after the load")
        if self.final_request_status != 200:
            checks.append(f"the final request got {self.final_request_status}, not 200")
        for kind, tally in self.edits.items():
            if tally.confirmed != tally.written:
                checks.append(f"{kind} edits: {tally.confirmed} of {tally.written} confirmed")
        if self.server_exit_code not in (None, 0):
            checks.append(f"the server exited with {self.server_exit_code}")
        return checks


def record(result: SoakResult, req: PlannedRequest, outcome: Outcome, is_load: bool) -> None:
    """Fold one exchange into the tallies."""
    load, status = result.load, "none" if outcome.status is None else str(outcome.status)
    if is_load:
        load.requests_sent += 1
        _bump(load.by_status, status)
        _bump(load.by_kind, req.tally_kind)
    else:
        _bump(load.other_by_status, status)
    if req.expect is not None:
        load.hostile_sent += 1
        if outcome.status != req.expect and outcome.result == "completed":
            load.hostile_unexpected += 1
            result.problem(f"{req.kind}: got {status}, expected {req.expect}")
    if outcome.status is not None and outcome.status >= 500:
        load.client_5xx += 1
    _count_result(load, req, outcome)
    load.stream_errors += outcome.stream_errors
    load.stream_server_errors += outcome.stream_server_errors
    load.non_openai_errors += outcome.non_openai_errors
    load.bad_successes += outcome.bad_successes
    for problem in outcome.problems:
        result.problem(problem)


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _count_result(load: LoadTally, req: PlannedRequest, outcome: Outcome) -> None:
    if outcome.result == "timed_out":
        load.timed_out += 1
    elif outcome.result == "transport_error":
        load.transport_errors += 1
    elif outcome.result == "nonstream_cut":
        load.nonstream_cut += 1
    elif req.stream and outcome.status == 200:
        if outcome.result == "cut":
            load.streams_cut += 1
        elif outcome.broken_stream:
            load.streams_broken += 1
        else:
            load.streams_completed += 1
    elif not req.stream and req.client_timeout_s is not None:
        load.nonstream_completed += 1
