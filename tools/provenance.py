"""Where a tool's figures came from: every benchmark and soak report records the code's git
revision next to its command, date and CPU capability."""

from __future__ import annotations

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
