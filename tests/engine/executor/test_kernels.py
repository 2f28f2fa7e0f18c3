"""How the C++ kernels are built: for the instruction set torch runs with, cached by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.executor import kernels


@pytest.mark.parametrize(
    ("capability", "march"),
    [("AVX512", "-march=native"), ("AVX2", "-march=x86-64-v3"), ("DEFAULT", None)],
)
def test_kernels_target_the_capability_torch_runs_with(
    capability: str, march: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    flags = kernels.compile_flags()
    assert [f for f in flags if f.startswith("-march")] == ([march] if march else [])
    assert "-O3" in flags and "-fopenmp" in flags


def test_an_avx2_build_is_cached_apart_from_an_avx512_one(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = set()
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        keys.add(kernels.kernel_cache_key())
    assert len(keys) == 2


def test_the_shared_header_is_part_of_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = tmp_path / "vec.h"
    header.write_text("// one")
    monkeypatch.setattr(kernels, "HEADERS", (header,))
    before = kernels.kernel_cache_key()
    header.write_text("// two")
    assert kernels.kernel_cache_key() != before
