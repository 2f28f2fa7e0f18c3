"""A model's first start: seconds from process start to /health 200 with nothing cached but
the compiled kernels (a model brought to a machine that already served another), where they
go, what the cache folder holds afterwards, and a second start on that folder.

Each round starts a server with `PREFIXGATE_CACHE_DIR` pointing at an empty temporary folder
whose `kernels/` links to the default cache's (built first if missing: the kernel build is
once per machine, not per model), then starts it again on the same folder. The breakdown
comes from the server's log lines (`tools.bench_restart.breakdown`), with the GGUF's one-time
conversion as its own milestone. Each server listens on 127.0.0.1 and is stopped by its PID.

    .venv/bin/python -m tools.bench_first_start --model FILE.gguf --out docs/results/x/first.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.core.config import default_cache_dir
from engine.core.cpu import cpu_features
from engine.executor.kernels import build_cpu_kernels
from tools.bench_restart import READY_TIMEOUT_S, breakdown
from tools.local_server import local_server
from tools.provenance import git_revision, write_report

MILESTONES = (
    ("imports", "starting prefixgate"),
    ("gguf_conversion", "engine.loading.source: converted "),
    ("config_and_tokenizer", "chat template:"),
    ("weights_and_kernels", "engine.loading.setup: model "),
    ("kv_cache", "engine.loading.setup: KV cache:"),
    ("engine_ready", "gateway.state: ready: serving"),
)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--chat-template", default=None)
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--rounds", type=int, default=2, help="first starts, each on a new folder")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    kernels = default_cache_dir() / "kernels"
    if not build_cpu_kernels(default_cache_dir()).is_built:
        sys.exit("the CPU kernels do not build here: nothing comparable to measure")
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="prefixgate-first-") as tmp:
            cache = Path(tmp)
            (cache / "kernels").symlink_to(kernels, target_is_directory=True)
            first = _start(args, cache, "first")
            second = _start(args, cache, "second")
            rounds.append({"first": first, "second": second, "cache_mb": _sizes(cache)})
        print(json.dumps(rounds[-1]), flush=True)
    report: dict[str, object] = {
        "command": " ".join(["python", "-m", "tools.bench_first_start", *argv]),
        "git": git_revision(),
        "cpu": cpu_features().describe(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": rounds,
    }
    write_report(report, args.out)
    return report


def _start(args: argparse.Namespace, cache: Path, name: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "prefixgate", "serve", "--host", "127.0.0.1",
        "--port", str(args.port), "--kv-cache-memory", args.kv_cache_memory,
    ]  # fmt: skip
    command += ["--model", args.model] if args.model else []
    command += ["--chat-template", args.chat_template] if args.chat_template else []
    command += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    env = {**os.environ, "PREFIXGATE_CACHE_DIR": str(cache)}
    log = cache.parent / f"{cache.name}-{name}.log"
    spawned = time.time()
    try:
        with local_server(command, args.port, log, READY_TIMEOUT_S, 60.0, env, 0.05):
            ready_s = time.time() - spawned
        text = log.read_text(encoding="utf-8", errors="replace")
    finally:
        log.unlink(missing_ok=True)
    return {
        "health_200_s": round(ready_s, 2),
        "breakdown_s": breakdown(text, spawned, ready_s, MILESTONES),
    }


def _sizes(cache: Path) -> dict[str, float]:
    """MB under each entry of the cache folder but the linked kernels."""
    sizes = {}
    for entry in sorted(cache.iterdir()):
        if entry.name == "kernels":
            continue
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        sizes[entry.name] = round(sum(p.stat().st_size for p in files) / 1e6, 1)
    return sizes


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
