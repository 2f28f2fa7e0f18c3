"""Where a tool's figures came from: every benchmark and soak report records the code's git
revision next to its command, date and CPU capability."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_revision() -> str:
    """The checkout's short revision, or "unknown" outside a git checkout."""
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_capability() -> str:
    """torch's CPU capability as a server started from here runs it: ATEN_CPU_CAPABILITY
    (how a run caps itself to AVX2) where set, else what torch detects."""
    import torch

    return os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()


def write_report(report: dict[str, object], out: Path | None) -> None:
    """A tool's report: one JSON line on stdout, and indented into `out` when given."""
    print(json.dumps(report))
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
