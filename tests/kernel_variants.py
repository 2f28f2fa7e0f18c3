"""The C++ kernels of the other instruction sets, built in the background while the suite runs.

tests/engine/executor/test_kernels.py builds the kernels for each instruction set this
machine is not (AVX2 on an AVX-512 CPU, the portable scalar code everywhere) and runs the
kernel tests against each. One build takes ~65 s of both cores of a 2-core CPU, most of the
suite leaves a core idle, and the build needs nothing from the tests: so when that test is
selected, it runs last and its builds start in the background at the lowest CPU priority,
into the cache the test then finds them in.

Not beside the tests that run the engine's parallel code, though: even at nice 19 (or
SCHED_IDLE) a compiler on a 2-core machine made a real-model engine's requests up to 15x
slower (a Responses test took 31 s instead of 2 s), and the engine's own tests ~2x slower
(the attention kernel's: 61 s instead of 5): the two threads meet at a barrier after every
parallel section, and one of them waiting for a core stalls both. The builds start with the
first test past tests/e2e and tests/engine (tests/conftest.py): the servers' tests, which
mostly wait on sockets and processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests import prewarm

# instruction set (ATEN_CPU_CAPABILITY) -> (torch's capability name, the -march it builds with)
VARIANTS = {"avx2": ("AVX2", "-march=x86-64-v3"), "default": ("DEFAULT", None)}
SELECTING_TEST = "test_other_instruction_set_builds_pass_the_kernel_tests"


@dataclass
class VariantBuild:
    process: subprocess.Popen[bytes]
    log: Path

    def wait(self, timeout: float) -> tuple[int, str]:
        """The build's exit status and its output, at full priority from now: the suite is
        over, and at nice 19 any process left busy (a stray server) would starve it.

        Raises AssertionError with the build's output so far and what held the CPU where it
        does not end within `timeout`: a silent test timeout says nothing of why."""
        # lowering a niceness needs privilege: CI runs as root, elsewhere it stays 19
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, self.process.pid, 0)
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            busiest = subprocess.run(
                ["ps", "-eo", "pid,ni,pcpu,etime,args", "--sort=-pcpu"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.splitlines()[:12]
            raise AssertionError(
                f"the kernel build did not end within {timeout:.0f} s; its output:\n"
                + self.log.read_text(errors="replace")[-3000:]
                + "\nthe busiest processes:\n"
                + "\n".join(line[:160] for line in busiest)
            ) from None
        return returncode, self.log.read_text(errors="replace")


_builds: dict[str, VariantBuild] = {}
_wanted: list[str] = []


def want_builds(capabilities: list[str]) -> None:
    """`start_wanted_builds` will start these."""
    _wanted[:] = capabilities


def start_wanted_builds() -> None:
    """The wanted builds, once: called before each test that does not run the real model."""
    if _wanted:
        start_builds(_wanted)
        _wanted.clear()


def other_variants() -> list[str]:
    host = torch.backends.cpu.get_cpu_capability()
    return [name for name, (capability, _) in VARIANTS.items() if capability != host]


def variant_env(capability: str) -> dict[str, str]:
    return {**os.environ, "ATEN_CPU_CAPABILITY": capability, prewarm.NO_PREWARM: "1"}


def start_builds(capabilities: list[str]) -> None:
    """`python -m engine.executor.kernels` per capability at nice 19, output to a log file."""
    log_dir = Path(tempfile.mkdtemp(prefix="prefixgate-kernel-builds-"))
    for capability in capabilities:
        if capability in _builds:
            continue
        log = log_dir / f"{capability}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-m", "engine.executor.kernels"],
                env=variant_env(capability),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: ninja and the compilers too
            )
        _builds[capability] = VariantBuild(process, log)


def build_of(capability: str) -> VariantBuild | None:
    return _builds.get(capability)


def stop_builds() -> None:
    """At the end of the session: no build outlives it, nor its compilers. The next build
    into the folder is not stopped by what this one leaves (engine.executor.kernels'
    `_builder_lock`)."""
    for build in _builds.values():
        if build.process.poll() is None:
            os.killpg(build.process.pid, signal.SIGKILL)
            build.process.wait()
    _builds.clear()
