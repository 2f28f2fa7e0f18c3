"""How long a killed Ray Serve replica takes to serve again (issue 28: <= 5 s): two engine
replicas behind the ingress, one replica's worker process killed with SIGKILL, then the
milestones of its replacement, each in seconds from the kill.

    .venv/bin/python tools/bench_replica_replacement.py --kills 3 \\
        --out docs/results/DATE-replacement/replacement.json

One `prefixgate serve --replicas 2 --ray-address local` on 127.0.0.1 (stopped by PID) with the
shipped prefixes and the default snapshot folder, so a replacement restores the registry's KV
from the snapshot its predecessor wrote instead of prefilling. Each kill comes `--settle`
seconds after the pair is whole again (default 0: back to back). Polled every `--poll` seconds:

- `degraded`: /health says "degraded" (Serve saw the replica gone);
- `process`: a new `ServeReplica:prefixgate:engine` process exists;
- `listed`: the ingress lists two replicas with one registry digest again, one of them new;
- `served`: a one-token chat completion ran on the new replica (two are sent at a time, so
  the least-loaded choice reaches it; the replica's own lookup count says where they ran):
  the moment those requests were answered, once the ingress's next report of the count shows
  they ran there (the report comes up to a poll interval later).

`served` is the issue's "routed to again". The new replica's own log lines (model load,
kernels, registry restore) are kept in the report, which is written to `--out` with the git
revision and CPU capability; a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.local_server import local_server
from tools.provenance import cpu_capability, git_revision

MILESTONES = ("degraded", "process", "listed", "served")
REPLICA_MARK = b"ServeReplica:prefixgate:engine"
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Replacement:
    """One kill: seconds from the kill to each milestone (None: not seen in time)."""

    victim: int
    killed_at: float = 0.0  # epoch seconds, to place the replica's own log lines
    seconds: dict[str, float | None] = field(default_factory=dict)
    new_replica: str | None = None
    new_pid: int | None = None
    log: list[str] = field(default_factory=list)
    # seconds from the kill to the replica's first log line and to its "serves" line
    replica_log_s: dict[str, float | None] = field(default_factory=dict)


def replica_pids(proc: Path = Path("/proc")) -> list[int]:
    """Engine replicas' worker processes: Ray names them `ray::ServeReplica:<app>:<name>`."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if REPLICA_MARK in command:
            pids.append(int(entry.name))
    return sorted(pids)


def healthy_pair(listing: dict[str, Any]) -> bool:
    """Two replicas that answer with one registry digest."""
    replicas = listing.get("replicas") or []
    digests = {r.get("digest") for r in replicas}
    return len(replicas) == 2 and len(digests) == 1 and None not in digests


def summarize(kills: list[Replacement]) -> dict[str, Any]:
    """Per milestone: each kill's seconds and their median (over the kills that reached it)."""
    medians: dict[str, float | None] = {}
    for name in MILESTONES:
        seen = [s for k in kills if (s := k.seconds.get(name)) is not None]
        medians[name] = round(statistics.median(seen), 2) if seen else None
    return {"kills": [asdict(k) for k in kills], "median_s": medians}


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| kill | " + " | ".join(f"{m} s" for m in MILESTONES)]
    lines[0] += " | replica's first log line s | replica ready s |"
    lines.append("|---" * (len(MILESTONES) + 3) + "|")

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for i, kill in enumerate(summary["kills"], 1):
        own = kill["replica_log_s"]
        cells = [cell(kill["seconds"].get(m)) for m in MILESTONES]
        cells += [cell(own.get("first_line")), cell(own.get("serves"))]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    median = summary["median_s"]
    lines.append("| median | " + " | ".join(cell(median[m]) for m in MILESTONES) + " | | |")
    return "\n".join(lines)


class Cluster:
    """The server under test, seen through its HTTP API."""

    def __init__(self, base: str) -> None:
        self.client = httpx.Client(base_url=base, timeout=10.0)
        self.model = ""

    def health(self) -> str:
        try:
            return str(self.client.get("/health").json().get("status", ""))
        except (httpx.HTTPError, ValueError):
            return "unreachable"

    def listing(self) -> dict[str, Any]:
        try:
            return dict(self.client.get("/v1/prefixes").json())
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_pair(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listing = self.listing()
            if self.health() == "ok" and healthy_pair(listing):
                return listing
            time.sleep(0.2)
        raise SystemExit(f"no two healthy replicas with one registry within {timeout:.0f} s")

    def lookups_seen(self, name: str, timeout: float) -> bool:
        """Whether replica `name` reports lookups within the ingress's next polls."""
        deadline = time.monotonic() + min(timeout, 3.0)
        while time.monotonic() < deadline:
            cards = [r for r in self.listing().get("replicas") or [] if r["name"] == name]
            if cards and (cards[0].get("lookups") or 0) > 0:
                return True
            time.sleep(0.05)
        return False

    def one_token(self) -> bool:
        if not self.model:
            self.model = self.client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}
        try:
            reply = self.client.post(
                "/v1/chat/completions", json={**body, "max_tokens": 1, "temperature": 0}
            )
        except httpx.HTTPError:
            return False
        return reply.status_code == 200


def replace_once(cluster: Cluster, args: argparse.Namespace, log: Path) -> Replacement:
    """Kill one replica of a healthy pair; watch its replacement until it has served."""
    before = cluster.wait_pair(args.timeout)
    if args.settle > 0:
        time.sleep(args.settle)
        before = cluster.wait_pair(args.timeout)
    names = {r["name"] for r in before["replicas"]}
    pids = replica_pids()
    kill = Replacement(victim=pids[0])
    log_offset = log.stat().st_size
    started, kill.killed_at = time.monotonic(), time.time()
    os.kill(kill.victim, signal.SIGKILL)

    def mark(name: str) -> None:
        if kill.seconds.get(name) is None:
            kill.seconds[name] = round(time.monotonic() - started, 3)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        while time.monotonic() - started < args.timeout and kill.seconds.get("served") is None:
            if cluster.health() == "degraded":
                mark("degraded")
            fresh = [p for p in replica_pids() if p not in pids]
            if fresh:
                kill.new_pid = fresh[0]
                mark("process")
            listing = cluster.listing()
            new = [r for r in listing.get("replicas") or [] if r["name"] not in names]
            if new and healthy_pair(listing):
                kill.new_replica = new[0]["name"]
                mark("listed")
                list(pool.map(lambda _: cluster.one_token(), range(2)))
                answered = round(time.monotonic() - started, 3)
                if cluster.lookups_seen(new[0]["name"], args.timeout):
                    # The new replica's count moved: these requests ran there. They ended at
                    # `answered`; the ingress reports counts only at its next poll.
                    kill.seconds.setdefault("served", answered)
                    continue
            time.sleep(args.poll)
    for name in MILESTONES:
        kill.seconds.setdefault(name, None)
    with log.open("rb") as out:
        out.seek(log_offset)
        text = out.read().decode(errors="replace")
    if kill.new_pid is not None:
        kill.log = [line for line in text.splitlines() if f"pid={kill.new_pid}" in line][:60]
    kill.replica_log_s = replica_log_seconds(kill.log, kill.killed_at)
    return kill


def replica_log_seconds(lines: list[str], killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill to the new replica's first log line (its imports are done) and
    to its "replica ... serves" line (model, kernels and registry ready)."""
    stamps = []
    for line in lines:
        match = STAMP.search(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stamps.append((round(when - killed_at, 2), line))
    serves = [s for s, line in stamps if "replicas.replica: replica" in line and " serves " in line]
    return {
        "first_line": stamps[0][0] if stamps else None,
        "serves": serves[0] if serves else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="replicas killed, one after another")
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between looks")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds a whole pair runs before the next kill (0: kills back to back, as a "
        "burst of failures; the server's spare worker needs a few seconds to be ready again)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a kill may take")
    parser.add_argument("--server-flags", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    command = [sys.executable, "-m", "prefixgate", "serve", "--port", str(args.port)]
    command += ["--prefixes", "prefixes.yaml", "--replicas", "2", "--ray-address", "local"]
    command += args.server_flags.split()
    with local_server(command, args.port, log, ready_timeout=600.0):
        cluster = Cluster(f"http://127.0.0.1:{args.port}")
        kills = [replace_once(cluster, args, log) for _ in range(args.kills)]
    summary = summarize(kills)
    summary |= {
        "git_revision": git_revision(),
        "command": " ".join(sys.argv),
        "cpu_capability": cpu_capability(),
        "cpus": os.cpu_count(),
    }
    args.out.write_text(json.dumps(summary, indent=2))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
