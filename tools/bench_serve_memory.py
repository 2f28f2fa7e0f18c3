"""Peak memory of `prefixgate serve` with the default model, at each kind of start.

The issue-12 target: peak RSS <= 1 GB with a 512 MB KV budget. A start's peak depends on what
the cache dir already holds, so each start gets its own cache dir under a temporary folder,
the compiled C++ kernels copied in from the default one (compiling runs in child processes,
but takes ~20 s):

- fresh: nothing cached: the GGUF is converted (in a spawned process) and quantized;
- first: the conversion cached, no quantized weights (a new torch, a new dtype...);
- second: both cached, the usual start.

Each server listens on 127.0.0.1, answers three chat requests, and is stopped by its PID; the
figures are VmHWM and VmRSS from /proc/PID/status (Linux only) after those requests.

    .venv/bin/python -m tools.bench_serve_memory --out docs/results/x/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.core.config import default_cache_dir
from engine.core.cpu import cpu_features
from tools.local_server import local_server
from tools.provenance import REPO, git_revision

STARTS = ("fresh", "first", "second")
READY_TIMEOUT_S = 300.0
CAPABILITY_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # recorded where set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--prefixes", default=str(REPO / "prefixes.yaml"))
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-mem-") as tmp:
        cache = Path(tmp) / "cache"
        kernels = default_cache_dir() / "kernels"
        if kernels.is_dir():
            shutil.copytree(kernels, cache / "kernels")
        for start in STARTS:
            if start == "first":
                shutil.rmtree(cache / "quantized", ignore_errors=True)
            results.append({"start": start, **_measure(args, cache, Path(tmp) / f"{start}.log")})
            print(json.dumps(results[-1]), flush=True)
    report = {
        "command": " ".join([Path(sys.executable).name, "-m", "tools.bench_serve_memory"]),
        "git": git_revision(),
        "cpu": cpu_features().describe(),
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        },
        "kv_cache_memory": args.kv_cache_memory,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "starts": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _measure(args: argparse.Namespace, cache: Path, log: Path) -> dict[str, float]:
    command = [
        sys.executable, "-m", "prefixgate", "serve", "--host", "127.0.0.1",
        "--port", str(args.port), "--prefixes", args.prefixes,
        "--kv-cache-memory", args.kv_cache_memory,
    ]  # fmt: skip
    env = {**os.environ, "PREFIXGATE_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    with local_server(command, args.port, log, READY_TIMEOUT_S, 30.0, env) as server:
        ready_s = time.perf_counter() - started
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models") as reply:
            model = json.load(reply)["data"][0]["id"]
        for i in range(3):
            _chat(args.port, model, f"Say hello number {i}")
        status = _proc_status(server.pid)
    return {
        "ready_s": round(ready_s, 1),
        "peak_rss_gb": round(status["VmHWM"] * 1024 / 1e9, 3),
        "rss_gb": round(status["VmRSS"] * 1024 / 1e9, 3),
    }


def _chat(port: int, model: str, text: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 20}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()


def _proc_status(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0])
    return fields


if __name__ == "__main__":
    main()
