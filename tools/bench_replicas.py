"""What Ray Serve costs: the `intent` workload at a fixed rate through the single-process
server, then Ray Serve with one engine replica, then with two, one after another in one run.

    .venv/bin/python tools/bench_replicas.py --qps 1 --num-requests 64 \\
        --out-dir docs/results/2026-11-24-replicas

Each configuration is a fresh `prefixgate serve` on 127.0.0.1 (stopped by PID), loaded by
tools/bench_serving.py (streaming chat, Poisson arrivals at `--qps`, the same seed for all,
bounded by `--max-duration`). Reported per configuration: TTFT / TPOT / e2e p50 and p95, the
registry hit rate (requests whose `cached_tokens` cover the registered prefix they start
with) and, on Ray, the requests each replica served. The ingress's added TTFT is the p50 of one
replica on Ray minus the single-process p50: the same engine and threads, with the ingress,
Serve's proxy and its router in front. Two replicas on this machine's 2 cores share them
(one torch thread each), so expect little gain: the point is the overhead.

That difference has two parts, which `single-process-beside-idle-ray` tells apart: the
single-process server measured while a Ray Serve application (one replica, no traffic) runs
beside it on another port. Against the plain single process it is what Ray's processes
(GCS, raylet, Serve's controller and proxy, each replica's Ray threads: ~1,400 wakeups a
second at rest) take from the engine's threads; Ray with one replica against it is the
request path itself (proxy, ingress, handle, the stream back).

Writes `<out-dir>/<config>.json` (bench_serving's report), `<config>.log` (the server's) and
`summary.json`; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.local_server import local_server
from tools.provenance import REPO, cpu_capability, git_revision

PREFIX = "intent-classifier"


@dataclass(frozen=True)
class Setup:
    """`beside_idle_ray`: run an idle one-replica Ray Serve app on the next port meanwhile."""

    name: str
    flags: tuple[str, ...]
    beside_idle_ray: bool = False


RAY_1_REPLICA = ("--replicas", "1", "--ray-address", "local")
SETUPS = (
    Setup("single-process", ()),
    Setup("single-process-beside-idle-ray", (), beside_idle_ray=True),
    Setup("ray-1-replica", RAY_1_REPLICA),
    Setup("ray-2-replicas", ("--replicas", "2", "--num-threads", "1")),
    # Four tokens a message from the replica: a quarter of the messages, burstier streams.
    Setup("ray-1-replica-stream-4", (*RAY_1_REPLICA, "--stream-interval", "4")),
    # One torch thread: a core stays free for Ray's processes (proxy, ingress, raylet), so the
    # difference is the hops' latency more than their CPU taken from the engine.
    Setup("single-process-1-thread", ("--num-threads", "1")),
    Setup("ray-1-replica-1-thread", (*RAY_1_REPLICA, "--num-threads", "1")),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qps", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, help="a fixed concurrency instead of --qps")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-duration", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=8095)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="run these configurations only")
    parser.add_argument("--server-flags", default="", help="more `prefixgate serve` flags")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for setup in SETUPS:
        if args.only and setup.name not in args.only:
            continue
        results[setup.name] = run_setup(setup, args)
    summary = summarize(results)
    summary.update(
        git_revision=git_revision(),
        command=" ".join(sys.argv),
        cpu_capability=cpu_capability(),
    )
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(markdown(summary))
    return 0


def run_setup(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, load it, read its registry listing, stop it (SIGTERM, by PID)."""
    with contextlib.ExitStack() as servers:
        if setup.beside_idle_ray:
            port = args.port + 1
            idle = _serve_command(port, RAY_1_REPLICA, args)
            servers.enter_context(local_server(idle, port, args.out_dir / "idle-ray.log"))
        return _measure(setup, args)


def _serve_command(port: int, flags: tuple[str, ...], args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "prefixgate", "serve", "--port", str(port)]
    return [*command, "--prefixes", "prefixes.yaml", *flags, *args.server_flags.split()]


def _measure(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    base = f"http://127.0.0.1:{args.port}"
    command = _serve_command(args.port, setup.flags, args)
    log = args.out_dir / f"{setup.name}.log"
    with local_server(command, args.port, log):
        load = (
            ["--concurrency", str(args.concurrency)]
            if args.concurrency
            else ["--qps", str(args.qps), "--arrival", "poisson"]
        )
        report = args.out_dir / f"{setup.name}.json"
        subprocess.run(
            [
                sys.executable,
                "tools/bench_serving.py",
                *("--base-url", f"{base}/v1", "--label", setup.name, "--workload", "intent"),
                *load,
                *("--num-requests", str(args.num_requests), "--warmup", "2"),
                *("--max-duration", str(args.max_duration), "--out", str(report)),
            ],
            cwd=REPO,
            check=True,
        )
        listing = httpx.get(f"{base}/v1/prefixes", timeout=30.0).json()
        return {
            "report": json.loads(report.read_text()),
            "listing": listing,
            "floor": measure_floor(base),
        }


def measure_floor(base: str, num: int = 25) -> dict[str, float]:
    """The fixed cost of a hop, without the workload: p50 ms of `GET /v1/models` (HTTP and
    the ingress, no engine) and of a one-token chat completion of "hi" (the whole path with
    the smallest engine step), `num` each, sequential, after 5 unmeasured."""
    with httpx.Client(base_url=base, timeout=30.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        body |= {"max_tokens": 1, "temperature": 0}

        def p50(call: Any) -> float:
            times = []
            for i in range(num + 5):
                start = time.perf_counter()
                call().raise_for_status()
                if i >= 5:
                    times.append(1000 * (time.perf_counter() - start))
            return sorted(times)[len(times) // 2]

        return {
            "models_p50_ms": p50(lambda: client.get("/v1/models")),
            "one_token_chat_p50_ms": p50(lambda: client.post("/v1/chat/completions", json=body)),
        }


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    for name, result in results.items():
        step = result["report"]["steps"][0]
        summary, requests = step["summary"], step["requests"]
        [entry] = [p for p in result["listing"]["data"] if p["name"] == PREFIX]
        done = [r for r in requests if r["status"] == "ok"]
        hits = [r for r in done if (r.get("cached_tokens") or 0) >= entry["tokens"]]
        rows[name] = {
            "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "ttft_p95_ms": summary["ttft_ms"]["p95"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"],
            "e2e_p50_ms": summary["e2e_ms"]["p50"],
            "e2e_p95_ms": summary["e2e_ms"]["p95"],
            "output_throughput": summary["output_throughput"],
            "completed": len(done),
            "errors": summary["num_errors"],
            "registry_hit_rate": len(hits) / len(done) if done else None,
            **result["floor"],
            "replica_requests": {
                r["name"]: r["lookups"] for r in result["listing"].get("replicas") or []
            },
        }
    return {
        "rows": rows,
        "ingress_added_ttft_p50_ms": _added(rows, "single-process", "ray-1-replica"),
        "ray_beside_added_ttft_p50_ms": _added(
            rows, "single-process", "single-process-beside-idle-ray"
        ),
        "request_path_added_ttft_p50_ms": _added(
            rows, "single-process-beside-idle-ray", "ray-1-replica"
        ),
        "ingress_added_ttft_p50_ms_1_thread": _added(
            rows, "single-process-1-thread", "ray-1-replica-1-thread"
        ),
    }


def _added(rows: dict[str, dict[str, Any]], single: str, ray: str) -> float | None:
    if single not in rows or ray not in rows:
        return None
    return float(rows[ray]["ttft_p50_ms"] - rows[single]["ttft_p50_ms"])


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| configuration | TTFT p50 / p95 ms | TPOT p50 ms | e2e p50 / p95 ms | tok/s | "
        "completed (errors) | registry hit rate | requests per replica | GET /v1/models p50 ms "
        "| 1-token chat p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["rows"].items():
        per_replica = ", ".join(f"{n}: {h}" for n, h in row["replica_requests"].items()) or "-"
        lines.append(
            f"| {name} | {row['ttft_p50_ms']:.1f} / {row['ttft_p95_ms']:.1f} | "
            f"{row['tpot_p50_ms']:.1f} | {row['e2e_p50_ms']:.0f} / {row['e2e_p95_ms']:.0f} | "
            f"{row['output_throughput']:.1f} | {row['completed']} ({row['errors']}) | "
            f"{100 * row['registry_hit_rate']:.0f}% | {per_replica} | "
            f"{row['models_p50_ms']:.1f} | {row['one_token_chat_p50_ms']:.1f} |"
        )
    added = summary["ingress_added_ttft_p50_ms"]
    if added is not None:
        lines.append(f"\nIngress-added TTFT p50 (Ray, 1 replica - single process): {added:.1f} ms")
    for key, text in [
        ("ray_beside_added_ttft_p50_ms", "of which an idle Ray beside the single process"),
        ("request_path_added_ttft_p50_ms", "of which the request path (Ray - beside idle Ray)"),
    ]:
        if summary.get(key) is not None:
            lines.append(f"  {text}: {summary[key]:.1f} ms")
    added = summary["ingress_added_ttft_p50_ms_1_thread"]
    if added is not None:
        lines.append(f"Ingress-added TTFT p50, one torch thread each: {added:.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
