"""What this machine's CPU and Linux offer the kernels: the tests that check which path a
kernel names compute the answer from here, not from the kernel."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The flags line of /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    return set(next(line for line in cpuinfo if line.startswith("flags")).split())


def linux_grants_amx() -> bool:
    """What the kernels ask Linux for before they use AMX tiles (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA); asking twice is harmless."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(158, 0x1023, 18)) == 0  # SYS_arch_prctl on x86-64
