"""One `prefixgate serve` for a benchmark: started on 127.0.0.1, ready when /health says 200,
stopped by its PID (SIGTERM, then SIGKILL) whatever happens in between."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tools.provenance import REPO


@contextlib.contextmanager
def local_server(
    command: Sequence[str],
    port: int,
    log: Path,
    ready_timeout: float = 300.0,
    stop_timeout: float = 90.0,
    env: Mapping[str, str] | None = None,
    poll_interval: float = 0.5,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `command` (which must listen on 127.0.0.1:`port`) with its output in `log`; yield
    the process once /health answers 200 (asked every `poll_interval` seconds)."""
    with log.open("wb") as out:
        server = subprocess.Popen(
            list(command), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_healthy(port, server, log, ready_timeout, poll_interval)
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_healthy(
    port: int, server: subprocess.Popen[bytes], log: Path, timeout: float, poll_interval: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll_interval)
    raise SystemExit(f"the server was not ready in {timeout:.0f} s; see {log}")
