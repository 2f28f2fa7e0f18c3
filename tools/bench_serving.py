"""Load generator for any OpenAI-compatible server: streaming chat completions over HTTP.

    .venv/bin/python tools/bench_serving.py --base-url http://127.0.0.1:8000/v1 \\
        --workload intent --qps 1 --num-requests 64 --label prefixgate --out r.json
    .venv/bin/python tools/bench_serving.py --workload intent --sweep-qps 0.5,1,2,4 \\
        --label llama.cpp --base-url http://127.0.0.1:8080/v1 --extra-body '{"cache_prompt": true}'

Each request is `POST {base_url}/chat/completions` with `stream: true` and
`stream_options.include_usage`. Per request it records TTFT (until the first chunk with
content), every inter-token gap (ITL: between successive chunks with content), TPOT
((e2e - TTFT) / (output tokens - 1)), end-to-end latency, output tokens (usage, else the
number of content chunks) and usage.prompt_tokens_details.cached_tokens. All times are
measured from the moment the request is sent (for a late arrival, `submitted_s` -
`scheduled_s` in the JSON is how late). Percentiles interpolate linearly between ranks
(numpy's default). Load is either a fixed concurrency or an arrival rate (`--qps`);
`--sweep-qps` runs one step per rate and reports the highest rate that meets the SLO.
Every step stops by itself: after its requests, or at `--max-duration` (in-flight requests
are then cancelled and counted as such). Warmup requests have their own cap of the same size.

The JSON report (--out; tools/plot_bench.py reads it): schema, command, git_revision, label,
model, base_url, workload, date, settings (every option), steps (one per load step: qps or
concurrency, arrival, submit_schedule, summary, and requests: one record per request),
sweep (slo_latency_s, best_qps; null without --sweep-qps). Summary latencies are in ms,
per-request times in s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.provenance import git_revision
from tools.workloads import DEFAULT_MAX_TOKENS, WORKLOADS, WorkloadRequest, build_workload

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "prefixgate.bench_serving/1"
DEFAULT_PREFIX = {
    "intent": "intent-classifier",
    "unique": "intent-classifier",
    "chat-multi-turn": "support-assistant",
    "copy": "support-assistant",
}


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times in seconds; `submitted_s`/`scheduled_s` are offsets
    from the step's start. status: ok | error | cancelled (in flight at the cap) | not_sent."""

    index: int
    conversation: int
    turn: int
    status: str = "not_sent"
    scheduled_s: float | None = None
    submitted_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadSpec:
    """How requests are offered: `concurrency` in flight, or arrivals at `qps`."""

    concurrency: int | None = None
    qps: float | None = None
    arrival: str = "poisson"
    submit_schedule: str = "absolute"
    seed: int = 0


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [1000 * v for v in values_s]
    return {
        "mean": sum(ms) / len(ms) if ms else None,
        "p50": percentile(ms, 50),
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
    }


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Aggregate one step. Latency figures cover the requests that completed without error;
    throughputs divide by the step's wall time (first submission to last completion)."""
    ok = [r for r in records if r.status == "ok"]
    submitted = sorted(r.submitted_s for r in records if r.submitted_s is not None)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    # Multi-turn: the share of prompt tokens served from cache from the second turn on.
    later = [r for r in ok if r.turn >= 1 and r.prompt_tokens and r.cached_tokens is not None]
    later_prompt = sum(r.prompt_tokens or 0 for r in later)
    num_output = sum(r.output_tokens for r in ok)
    span = submitted[-1] - submitted[0] if len(submitted) > 1 else 0.0
    errors = [r.error for r in records if r.status == "error" and r.error]
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_errors": sum(r.status == "error" for r in records),
        "num_cancelled": sum(r.status == "cancelled" for r in records),
        "num_not_sent": sum(r.status == "not_sent" for r in records),
        "duration_s": duration_s,
        "achieved_qps": (len(submitted) - 1) / span if span > 0 else None,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": num_output / duration_s if duration_s > 0 else None,
        "total_output_tokens": num_output,
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
        "cached_share_later_turns": (
            sum(r.cached_tokens or 0 for r in later) / later_prompt if later_prompt else None
        ),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "first_errors": list(dict.fromkeys(errors))[:5],
    }


def meets_slo(summary: dict[str, Any], slo_latency_s: float) -> bool:
    """Every request completed, none failed, and e2e p95 is within the SLO."""
    p95 = summary["e2e_ms"]["p95"]
    complete = summary["num_completed"] == summary["num_requests"]
    return (
        complete and summary["num_errors"] == 0 and p95 is not None and p95 <= 1000 * slo_latency_s
    )


def best_qps(steps: list[dict[str, Any]], slo_latency_s: float) -> float | None:
    """The highest step QPS that meets the SLO (see `meets_slo`), or None."""
    passing = [s["qps"] for s in steps if meets_slo(s["summary"], slo_latency_s)]
    return max(passing, default=None)


# ---------------------------------------------------------------- arrivals


def arrival_offsets(num: int, qps: float, arrival: str, seed: int) -> list[float]:
    """Planned submission times (s from the start): the first at 0, then gaps of 1/qps
    (`fixed`) or exponential gaps of mean 1/qps drawn from random.Random(seed) (`poisson`)."""
    if arrival not in ("poisson", "fixed"):
        raise ValueError(f"unknown arrival {arrival!r}")
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.expovariate(qps) if arrival == "poisson" else 1 / qps
        offsets.append(t)
    return offsets


async def dispatch(
    offsets: list[float],
    schedule: str,
    submit: Callable[[int, float], None],
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    *,
    start: float | None = None,
) -> None:
    """Call submit(i, planned offset) for each arrival. `absolute`: request i is due at
    start + offsets[i] however late earlier ones were; `relative`: it is due one gap after
    the previous submission actually happened, so lateness accumulates. `start` (a `clock`
    time) defaults to now."""
    start = previous = clock() if start is None else start
    for i, offset in enumerate(offsets):
        gap = offset - offsets[i - 1] if i else offset
        planned = offset if schedule == "absolute" else previous - start + gap
        if (delay := start + planned - clock()) > 0:
            await sleep(delay)
        previous = clock()
        submit(i, planned)


# ---------------------------------------------------------------- one request


async def send_request(
    client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str], rec: RequestRecord
) -> None:
    """Stream one chat completion into `rec`. The loop does one json.loads per SSE line."""
    now, loads = time.perf_counter, json.loads
    times: list[float] = []
    num_chunks, usage = 0, None
    rec.status = "cancelled"  # until it finishes either way
    start = now()
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:500]
            rec.status, rec.error = "error", f"HTTP {response.status_code}: {text}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": ping" comments, event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = loads(payload)
            if "error" in chunk:
                rec.status, rec.error = "error", f"stream error: {payload[:500]}"
                return
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    times.append(now())
                    num_chunks += 1
            usage = chunk.get("usage") or usage
    end = now()
    _finish(rec, start, end, times, num_chunks, usage)


def _finish(
    rec: RequestRecord,
    start: float,
    end: float,
    times: list[float],
    num_chunks: int,
    usage: dict[str, Any] | None,
) -> None:
    rec.status, rec.e2e_s = "ok", end - start
    rec.ttft_s = times[0] - start if times else None
    rec.itl_s = [b - a for a, b in itertools.pairwise(times)]
    rec.output_tokens = num_chunks
    if usage:
        completion_tokens = usage.get("completion_tokens")
        rec.output_tokens = completion_tokens if isinstance(completion_tokens, int) else num_chunks
        rec.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")


async def _send_safely(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: RequestRecord,
    timeout_s: float,
) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await send_request(client, url, body, headers, rec)
    except TimeoutError:
        rec.status, rec.error = "error", f"timeout after {timeout_s:g} s"
    except (httpx.HTTPError, OSError, ValueError, TypeError, AttributeError) as exc:
        # The last three: a chunk that is not JSON or not shaped like a chat chunk.
        rec.status, rec.error = "error", f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- one step


@dataclass
class Target:
    """Where requests go, and the time limits of a request and of a step."""

    base_url: str
    headers: dict[str, str]
    request_timeout_s: float
    max_duration_s: float

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.request_timeout_s)
        return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def request_bodies(
    requests: list[WorkloadRequest],
    model: str,
    max_tokens: int,
    temperature: float,
    extra: dict[str, Any],
) -> list[bytes]:
    base = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Free text, as OpenAI's default says: the shipped intent-classifier entry otherwise
        # constrains its hits to its label schema. `--extra-body` may set another format.
        "response_format": {"type": "text"},
    }
    return [json.dumps({**base, "messages": r.messages, **extra}).encode() for r in requests]


async def run_step(
    target: Target, requests: list[WorkloadRequest], bodies: list[bytes], load: LoadSpec
) -> tuple[list[RequestRecord], float]:
    """Offer `requests` as `load` says; return their records and the step's wall time."""
    records = [RequestRecord(i, r.conversation, r.turn) for i, r in enumerate(requests)]
    done = [asyncio.Event() for _ in requests]

    async def one(i: int) -> None:
        if (previous := requests[i].depends_on) is not None:
            await done[previous].wait()
        records[i].submitted_s = time.perf_counter() - start
        try:
            await _send_safely(
                client, target.url, bodies[i], target.headers, records[i], target.request_timeout_s
            )
        finally:
            done[i].set()

    async with target.client() as client:
        start = time.perf_counter()  # the origin of scheduled_s and submitted_s
        try:
            async with asyncio.timeout(target.max_duration_s), asyncio.TaskGroup() as group:
                _offer(group, one, len(requests), load, records, start)
        except TimeoutError:
            pass  # the TaskGroup has cancelled whatever was still running
        # The group ends with the last request (or at the cap): the step's wall time.
        duration = time.perf_counter() - start
    return records, duration


def _offer(
    group: asyncio.TaskGroup,
    one: Callable[[int], Coroutine[Any, Any, None]],
    num: int,
    load: LoadSpec,
    records: list[RequestRecord],
    start: float,
) -> None:
    if load.qps is None:
        indices = iter(range(num))

        async def worker() -> None:
            for i in indices:  # shared: each worker takes the next request when it is free
                await one(i)

        for _ in range(min(load.concurrency or 1, num)):
            group.create_task(worker())
        return

    def submit(i: int, scheduled: float) -> None:
        records[i].scheduled_s = scheduled
        group.create_task(one(i))

    offsets = arrival_offsets(num, load.qps, load.arrival, load.seed)
    group.create_task(dispatch(offsets, load.submit_schedule, submit, start=start))


async def warm_up(target: Target, bodies: list[bytes]) -> list[RequestRecord]:
    """Send `bodies` one after the other (not recorded in the results), within the cap."""
    records = [RequestRecord(i, i, 0) for i in range(len(bodies))]
    async with target.client() as client:
        try:
            async with asyncio.timeout(target.max_duration_s):
                for body, rec in zip(bodies, records, strict=True):
                    await _send_safely(
                        client, target.url, body, target.headers, rec, target.request_timeout_s
                    )
        except TimeoutError:
            pass
    return records


# ---------------------------------------------------------------- the run and its report


async def run_benchmark(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Every step (one, or one per --sweep-qps rate) in turn; the report is rewritten to
    --out after each step so that an interrupted sweep keeps what it measured."""
    report = _header(args, model)
    system_messages = _prefix_messages(args)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    target = Target(args.base_url, _headers(args.api_key), args.request_timeout, args.max_duration)
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    extra.update(args.extra_body)

    def bodies(num: int, stream: int | str) -> tuple[list[WorkloadRequest], list[bytes]]:
        requests = build_workload(
            args.workload, num, args.seed, system_messages, tokenizer, args.num_turns, stream
        )
        return requests, request_bodies(requests, model, args.max_tokens, args.temperature, extra)

    for step, load in enumerate(_loads(args)):
        if args.warmup:
            warm = await warm_up(target, bodies(args.warmup, f"warmup-{step}")[1])
            _warn_warmup(warm)
        requests, step_bodies = bodies(step_size(args, load), step)
        records, duration = await run_step(target, requests, step_bodies, load)
        report["steps"].append(_step_report(load, records, duration))
        print(_progress(report["steps"][-1]), file=sys.stderr, flush=True)
        if args.sweep_qps:
            report["sweep"] = {
                "slo_latency_s": args.slo_latency,
                "best_qps": best_qps(report["steps"], args.slo_latency),
            }
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def step_size(args: argparse.Namespace, load: LoadSpec) -> int:
    """Requests in one step: --num-requests, or at a rate with --step-duration, as many as
    arrive in that time (at least 10), so that low rates fit inside --max-duration."""
    if load.qps is None or args.step_duration is None:
        return int(args.num_requests)
    return min(int(args.num_requests), max(10, math.ceil(load.qps * float(args.step_duration))))


def _loads(args: argparse.Namespace) -> list[LoadSpec]:
    rates = args.sweep_qps or ([args.qps] if args.qps else [])
    if not rates:
        return [LoadSpec(concurrency=args.concurrency or 1)]
    return [LoadSpec(None, q, args.arrival, args.submit_schedule, args.seed) for q in rates]


def _step_report(load: LoadSpec, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    return {
        "qps": load.qps,
        "concurrency": load.concurrency,
        "arrival": load.arrival if load.qps else None,
        "submit_schedule": load.submit_schedule if load.qps else None,
        "summary": summarize(records, duration),
        "requests": [_record_json(r) for r in records],
    }


def _record_json(rec: RequestRecord) -> dict[str, Any]:
    out = asdict(rec)
    out["tpot_s"] = rec.tpot_s
    out["itl_s"] = [round(gap, 6) for gap in rec.itl_s]
    for key in ("scheduled_s", "submitted_s", "ttft_s", "e2e_s", "tpot_s"):
        if out[key] is not None:
            out[key] = round(out[key], 6)
    return out


def _header(args: argparse.Namespace, model: str) -> dict[str, Any]:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if settings["api_key"]:
        settings["api_key"] = "<redacted>"
    return {
        "schema": SCHEMA,
        "command": args.command,
        "git_revision": git_revision(),
        "label": args.label or model,
        "model": model,
        "base_url": args.base_url,
        "workload": args.workload,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": {k: v for k, v in settings.items() if k != "command"},
        "steps": [],
        "sweep": None,
    }


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _prefix_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    """The messages of the prefixes.yaml entry the workload starts from (none for
    decode-heavy). Read with yaml directly: the engine (and torch) is never imported."""
    name = args.prefix_name or DEFAULT_PREFIX.get(args.workload)
    if name is None:
        return []
    entries = yaml.safe_load(args.prefixes.read_text())["prefixes"]
    for entry in entries:
        if entry["name"] == name and "messages" in entry:
            return [{"role": m["role"], "content": m["content"]} for m in entry["messages"]]
    raise SystemExit(f"{args.prefixes} has no chat prefix named {name!r}")


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    tokenizer = Tokenizer.from_file(str(file))

    class _Encoder:
        def encode(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

    return _Encoder()


def _warn_warmup(records: list[RequestRecord]) -> None:
    failed = [r for r in records if r.status != "ok"]
    if failed:
        print(
            f"warning: {len(failed)} of {len(records)} warmup requests failed: {failed[0].error}",
            file=sys.stderr,
        )


def first_model(base_url: str, api_key: str | None, timeout_s: float) -> str:
    """The first model id of GET {base_url}/models."""
    url = base_url.rstrip("/") + "/models"
    response = httpx.get(url, headers=_headers(api_key), timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


# ---------------------------------------------------------------- printing


def _triple(dist: dict[str, float | None]) -> str:
    values = [dist["p50"], dist["p95"], dist["p99"]]
    return " / ".join("-" if v is None else f"{v:.0f}" for v in values)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _load_name(step: dict[str, Any]) -> str:
    if step["qps"] is None:
        return f"concurrency {step['concurrency']}"
    return f"{step['qps']:g} QPS {step['arrival']}/{step['submit_schedule']}"


def _progress(step: dict[str, Any]) -> str:
    s = step["summary"]
    return (
        f"{_load_name(step)}: {s['num_completed']}/{s['num_requests']} ok, "
        f"{s['num_errors']} errors in {s['duration_s']:.1f} s, "
        f"TTFT p50 {_num(s['ttft_ms']['p50'], '.0f')} ms, "
        f"e2e p95 {_num(s['e2e_ms']['p95'], '.0f')} ms"
    )


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"# {report['command']}",
        f"# {report['label']}: model {report['model']} at {report['base_url']}, workload "
        f"{report['workload']}, git {report['git_revision']}, {report['date']}",
        "| load | requests | ok | errors | unfinished | achieved QPS | TTFT ms p50/p95/p99 "
        "| TPOT ms p50/p95/p99 | ITL ms p50/p95/p99 | e2e ms p50/p95/p99 | req/s | output tok/s "
        "| cached tokens | cached share, turns 2+ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step in report["steps"]:
        s = step["summary"]
        lines.append(
            f"| {_load_name(step)} | {s['num_requests']} | {s['num_completed']} "
            f"| {s['num_errors']} | {s['num_cancelled'] + s['num_not_sent']} "
            f"| {_num(s['achieved_qps'], '.2f')} | {_triple(s['ttft_ms'])} "
            f"| {_triple(s['tpot_ms'])} | {_triple(s['itl_ms'])} | {_triple(s['e2e_ms'])} "
            f"| {_num(s['request_throughput'], '.2f')} | {_num(s['output_throughput'], '.1f')} "
            f"| {_num(s['cached_tokens_mean'], '.0f')} "
            f"| {_num(s['cached_share_later_turns'], '.0%')} |"
        )
    if report["sweep"]:
        sweep = report["sweep"]
        best = "none" if sweep["best_qps"] is None else f"{sweep['best_qps']:g}"
        lines.append(
            f"\nhighest QPS with e2e p95 <= {sweep['slo_latency_s']:g} s, every request "
            f"completed and no errors: {best}"
        )
    for step in report["steps"]:
        for error in step["summary"]["first_errors"]:
            lines.append(f"error at {_load_name(step)}: {error}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_positive_float(part) for part in text.split(",") if part.strip()]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        metavar="URL",
        help="OpenAI-compatible API root (default: %(default)s)",
    )
    add(
        "--model", metavar="NAME", help="model id to request (default: the first id of GET /models)"
    )
    add(
        "--api-key",
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY' (redacted in the printed and saved command)",
    )
    add(
        "--label",
        help="name of this system/config in the results and plots (default: the model id)",
    )
    add(
        "--workload",
        choices=WORKLOADS,
        default="intent",
        help="intent: the intent-classifier system prompt + a unique customer message; "
        "unique: the same with a nonce first, so no prefix can be reused (caching-off "
        "baseline); chat-multi-turn: conversations growing turn by turn, each turn sent after "
        "the previous one finished; decode-heavy: ~20-token prompts, long outputs; copy: the "
        "support-assistant entry and a request to quote or rewrite part of it "
        "(default: %(default)s; see tools/workloads.py)",
    )
    add(
        "--prefixes",
        type=Path,
        default=REPO / "prefixes.yaml",
        metavar="FILE",
        help="prefix file the system prompts come from (default: the repository's)",
    )
    add(
        "--prefix-name",
        metavar="NAME",
        help="entry of --prefixes the workload starts from (default: intent-classifier for "
        "intent/unique, support-assistant for chat-multi-turn and copy)",
    )
    add(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="tokenizer.json (or a folder holding one) to size messages in tokens (default: "
        "an approximation that loads no model; see tools/workloads.py)",
    )
    add(
        "--num-requests",
        type=_positive_int,
        default=64,
        metavar="N",
        help="measured requests per step (default: %(default)s)",
    )
    add(
        "--step-duration",
        type=_positive_float,
        default=None,
        metavar="S",
        help="with --qps/--sweep-qps: send at most QPS x S requests per step (at least 10, "
        "at most --num-requests), so that a sweep's low rates end in bounded time",
    )
    add(
        "--num-turns",
        type=_positive_int,
        default=4,
        metavar="T",
        help="turns per chat-multi-turn conversation (default: %(default)s)",
    )
    add(
        "--max-duration",
        type=_positive_float,
        default=600.0,
        metavar="S",
        help="wall-clock cap of each step, and of its warmup (s): stop submitting and cancel "
        "the requests in flight (default: %(default)g)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="C",
        help="keep C requests in flight (the default, with C=1)",
    )
    load.add_argument(
        "--qps",
        type=_positive_float,
        metavar="X",
        help="offer requests at X per second (see --arrival, --submit-schedule)",
    )
    load.add_argument(
        "--sweep-qps",
        type=_rates,
        metavar="X1,X2,...",
        help="one step per rate, each with the same settings and fresh messages; "
        "reports the highest rate meeting --slo-latency with no errors",
    )
    add(
        "--arrival",
        choices=["poisson", "fixed"],
        default="poisson",
        help="gaps between arrivals: exponential (seeded) or 1/X (default: %(default)s)",
    )
    add(
        "--submit-schedule",
        choices=["absolute", "relative"],
        default="absolute",
        help="absolute: request i is sent at start + its planned time even if earlier ones "
        "were late; relative: one gap after the previous submission (default: %(default)s)",
    )
    add("--seed", type=int, default=0, help="seeds the workload and the arrivals (default: 0)")
    add(
        "--max-tokens",
        type=_positive_int,
        metavar="N",
        help="output tokens per request (default: 30 intent/unique, 64 chat-multi-turn, "
        "128 decode-heavy)",
    )
    add("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    add(
        "--warmup",
        type=_count,
        default=0,
        metavar="K",
        help="K requests sent one by one before each step, not recorded (default: 0)",
    )
    add(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="object merged into every request body, last, e.g. '{\"cache_prompt\": false}' "
        "for llama.cpp",
    )
    add(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        help="send ignore_eos: true so every request writes --max-tokens tokens (prefixgate, "
        "vLLM, llama.cpp accept it; transformers serve answers 422 to unknown fields) "
        "(default: on for decode-heavy, off otherwise)",
    )
    add(
        "--slo-latency",
        type=_positive_float,
        default=2.0,
        metavar="S",
        help="e2e latency p95 SLO for --sweep-qps (s) (default: %(default)g)",
    )
    add(
        "--request-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="limit of one request, and of GET /models (s) (default: %(default)g)",
    )
    add(
        "--out",
        type=Path,
        metavar="FILE",
        help="write the JSON report here (rewritten after every step)",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = DEFAULT_MAX_TOKENS[args.workload]
    if args.ignore_eos is None:
        args.ignore_eos = args.workload == "decode-heavy"
    args.command = shlex.join(["tools/bench_serving.py", *_redacted(argv)])
    return args


def _redacted(argv: list[str]) -> list[str]:
    """argv with the API key's value hidden (the command is printed and saved)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = args.model or first_model(args.base_url, args.api_key, args.request_timeout)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"cannot list models at {args.base_url}: {exc}; pass --model", file=sys.stderr)
        return 2
    report = asyncio.run(run_benchmark(args, model))
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
