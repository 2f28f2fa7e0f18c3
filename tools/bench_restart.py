"""Restarts: seconds from process start to /health 200, cold (no KV snapshots) and warm (the
registry's snapshots and the hot set of the last graceful stop), where those seconds go, and
what a returning conversation finds cached after the restart.

Three registries: the shipped `prefixes.yaml`, and `--long N` entries of ~`--long-tokens`
tokens each (distinct generated text). For each, one cold start (an empty snapshot folder)
and `--rounds` warm ones (the same folder). The breakdown comes from the server's own log
lines (their timestamps, against the moment the process was spawned): imports (to the first
line), the model's config and tokenizer, weights and kernels, the KV cache, the registry
(filled or restored), and the rest to 200. The conversation: two chat turns on a warm server,
SIGTERM, a new start, the second turn again: its `cached_tokens` before and after.

Each server listens on 127.0.0.1 and is stopped by its PID.

    .venv/bin/python -m tools.bench_restart --out docs/results/x/restart.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from engine.core.cpu import cpu_features
from tools.local_server import local_server
from tools.provenance import REPO, git_revision, write_report

READY_TIMEOUT_S = 600.0
# (milestone, the log line that ends it): the first match after the previous milestone's.
MILESTONES = (
    ("imports", "starting prefixgate"),
    ("config_and_tokenizer", "chat template:"),
    ("weights_and_kernels", "engine.loading.setup: model "),
    ("kv_cache", "engine.loading.setup: KV cache:"),
    ("registry", "engine.registry.loader: prefix "),
    ("engine_ready", "gateway.state: ready: serving"),
)
_REGISTERED = re.compile(r"engine\.registry\.loader: prefix '[^']*': (\d+) tokens in")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
WORDS = (
    "account", "billing", "storage", "sync", "folder", "share", "invoice", "refund", "device",
    "backup", "restore", "upload", "download", "plan", "quota", "team", "admin", "password",
    "security", "export", "import", "photo", "video", "archive",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--rounds", type=int, default=3, help="warm starts per registry")
    parser.add_argument("--long", type=int, default=20, help="entries of the long registry")
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefixgate-restart-") as tmp:
        folder = Path(tmp)
        long_file = folder / "long.yaml"
        long_file.write_text(_long_registry(args.long, args.long_tokens), encoding="utf-8")
        registries = {"shipped": REPO / "prefixes.yaml", f"long-{args.long}": long_file}
        starts = {name: _starts(args, path, folder / name) for name, path in registries.items()}
        conversation = _conversation(args, registries["shipped"], folder / "conversation")
    report: dict[str, object] = {
        "command": " ".join(["python", "-m", "tools.bench_restart", *sys.argv[1:]]),
        "git": git_revision(),
        "cpu": cpu_features().describe(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "starts": starts,
        "conversation": conversation,
    }
    write_report(report, args.out)


def _command(args: argparse.Namespace, prefixes: Path, folder: Path) -> list[str]:
    command = [
        sys.executable, "-m", "prefixgate", "serve", "--host", "127.0.0.1",
        "--port", str(args.port), "--prefixes", str(prefixes),
        "--kv-cache-memory", args.kv_cache_memory,
        "--kv-snapshot-dir", str(folder / "kv"),
        "--response-store", f"sqlite:{folder / 'responses.sqlite3'}",
    ]  # fmt: skip
    return command + (["--model", args.model] if args.model else [])


def _starts(args: argparse.Namespace, prefixes: Path, folder: Path) -> list[dict[str, Any]]:
    """One cold start, then `rounds` warm ones on the same snapshot folder."""
    results = []
    for i in range(args.rounds + 1):
        log = folder / f"start-{i}.log"
        folder.mkdir(parents=True, exist_ok=True)
        spawned = time.time()
        with local_server(
            _command(args, prefixes, folder), args.port, log, READY_TIMEOUT_S, 60.0, None, 0.02
        ):
            ready_s = time.time() - spawned
        text = log.read_text(encoding="utf-8", errors="replace")
        results.append(
            {
                "kind": "cold" if i == 0 else "warm",
                "health_200_s": round(ready_s, 2),
                "breakdown_s": breakdown(text, spawned, ready_s),
                "registry_tokens": sum(map(int, _REGISTERED.findall(text))),
                "restored_prefixes": text.count("restored from its KV snapshot"),
                "hot_blocks_restored": _hot_blocks(text),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def _conversation(args: argparse.Namespace, prefixes: Path, folder: Path) -> dict[str, Any]:
    """Two turns and the second again, SIGTERM, a new start, the second turn once more: it
    must find what its replay found before the stop."""
    folder.mkdir(parents=True, exist_ok=True)
    command = _command(args, prefixes, folder)
    turns = [{"role": "user", "content": "Name three colours of the rainbow."}]
    with local_server(command, args.port, folder / "before.log", READY_TIMEOUT_S, 60.0, None, 0.02):
        first = _chat(args.port, turns)
        turns += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now two more, please."},
        ]
        _chat(args.port, turns)
        before = _chat(args.port, turns)  # the turn again: what its replay finds cached
    spawned = time.time()
    with local_server(command, args.port, folder / "after.log", READY_TIMEOUT_S, 60.0, None, 0.02):
        ready_s = time.time() - spawned
        after = _chat(args.port, turns)
    return {
        "prompt_tokens": before["usage"]["prompt_tokens"],
        "cached_tokens_before_restart": _cached(before),
        "cached_tokens_after_restart": _cached(after),
        "same_answer": before["choices"] == after["choices"],
        "health_200_s": round(ready_s, 2),
    }


def _chat(port: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        result: dict[str, Any] = json.load(reply)
    return result


def _cached(result: dict[str, Any]) -> int:
    return int(result["usage"]["prompt_tokens_details"]["cached_tokens"])


def breakdown(
    log: str,
    spawned: float,
    ready_s: float,
    milestones: tuple[tuple[str, str], ...] = MILESTONES,
) -> dict[str, float | None]:
    """Seconds of each of `milestones` (see MILESTONES), from the log's timestamps."""
    stamps: list[tuple[float, str]] = []
    for line in log.splitlines():
        match = _STAMP.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stamps.append((when, line))
    result: dict[str, float | None] = {}
    previous, position = spawned, 0
    for name, needle in milestones:
        hits = [i for i in range(position, len(stamps)) if needle in stamps[i][1]]
        if not hits:
            result[name] = None
            continue
        last = hits[-1] if name == "registry" else hits[0]  # the registry: its last entry
        result[name] = round(stamps[last][0] - previous, 2)
        previous, position = stamps[last][0], last + 1
    result["to_health_200"] = round(spawned + ready_s - previous, 2)
    return result


def _hot_blocks(log: str) -> int:
    match = re.search(r"(\d+) blocks restored from the hot snapshot", log)
    return int(match.group(1)) if match else 0


def _long_registry(entries: int, tokens: int) -> str:
    """`entries` text entries of ~`tokens` tokens each, distinct from their first words."""
    prefixes = []
    for i in range(entries):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(tokens)]
        prefixes.append({"name": f"long-{i:02d}", "text": f"Document {i}: " + " ".join(words)})
    return yaml.safe_dump({"version": 1, "prefixes": prefixes}, sort_keys=False)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
