"""The soak's report: JSON (what was run, on what, every count, the failures) and the same
as a Markdown table for the terminal."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any

from tools.provenance import git_revision
from tools.soak.config import SoakConfig
from tools.soak.runner import Run

SCHEMA = "prefixgate.soak/1"


def cpu_capability() -> tuple[str, str]:
    """torch's CPU capability (the kernels the server's matmuls use) and torch's version."""
    import torch  # here, not at the top: only the report needs it, and it is slow to import

    return str(torch.backends.cpu.get_cpu_capability()), str(torch.__version__)


def build_report(config: SoakConfig, outcome: Run) -> dict[str, Any]:
    capability, torch_version = cpu_capability()
    settings = asdict(config)
    settings["api_key"] = "<redacted>" if config.api_key else None
    settings["admin_api_key"] = "<redacted>" if config.admin_api_key else None
    result = outcome.result
    results = asdict(result)
    results["kv"]["leaked"] = result.kv.leaked
    results["load"]["disconnects"] = result.load.disconnects
    return {
        "schema": SCHEMA,
        "command": config.command,
        "git_revision": git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu_capability": capability,
        "torch": torch_version,
        "cpu_count": os.cpu_count(),
        "settings": json.loads(json.dumps(settings, default=str)),
        "server": {
            "url": outcome.target_url,
            "pid": outcome.server_pid,
            "log": outcome.server_log,
            "command": outcome.server_command,
            "exit_code": result.server_exit_code,
            "was_killed": result.server_was_killed,
        },
        "results": results,
        "failures": result.failures(),
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, then PASS or each failure, then the first problems."""
    lines = [
        f"# {report['command']}",
        f"# git {report['git_revision']}, {report['date']}, CPU capability "
        f"{report['cpu_capability']}, torch {report['torch']}, {report['cpu_count']} CPUs",
        "| check | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in _rows(report["results"])),
    ]
    lines += [f"FAIL: {failure}" for failure in report["failures"]] or ["PASS"]
    lines += [f"problem: {p}" for p in report["results"]["problems"][:10]]
    return "\n".join(lines)


def _rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    load, kv = r["load"], r["kv"]
    return [
        ("requests sent", load["requests_sent"]),
        ("by status", _join(load["by_status"])),
        ("by kind", _join(load["by_kind"])),
        (
            "streams completed / cut / broken",
            _slash(load["streams_completed"], load["streams_cut"], load["streams_broken"]),
        ),
        ("non-streaming requests cut by a client timeout", load["nonstream_cut"]),
        (
            "hostile bodies (sweep + load) / with an unexpected status",
            _slash(load["hostile_sent"], load["hostile_unexpected"]),
        ),
        (
            "5xx: responses / server metrics / stream server_error",
            _slash(load["client_5xx"], r["server_5xx"], load["stream_server_errors"]),
        ),
        ("errors not OpenAI-shaped", load["non_openai_errors"]),
        (
            "transport errors / unfinished requests",
            _slash(load["transport_errors"], load["timed_out"]),
        ),
        ("preemptions", r["preemptions"]),
        *(
            (f"{k} edits written / confirmed", _slash(v["written"], v["confirmed"]))
            for k, v in r["edits"].items()
        ),
        ("registry state checks / lost", _slash(r["state_checks"], r["lost_states"])),
        (
            "truncated edits acted on half-written / entries watched by hit count",
            _slash(r["half_file_seen"], r["sentinels_armed"]),
        ),
        (
            "KV blocks total / free / pinned / leaked",
            _slash(kv["total"], kv["free"], kv["pinned"], kv["leaked"]),
        ),
        ("idle at the end / final request", _slash(kv["idle"], r["final_request_status"])),
        (
            "server exit code / tracebacks in its log",
            _slash(r["server_exit_code"], r["server_tracebacks"]),
        ),
        ("duration (s)", r["duration_s"]),
    ]


def _join(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _slash(*values: Any) -> str:
    return " / ".join(str(v) for v in values)
