"""How the C++ kernels are built: for the instruction set torch runs with, cached by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.config import default_cache_dir
from engine.executor import kernels
from tests import kernel_variants


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


# -- what a build needs, and what happens when it fails -----------------------------------------
def test_a_failed_build_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No working compiler: the build says why (the compiler's own complaint), and the label
    the start-up line, /health and metrics show is "off"."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "kernel_cache_key", lambda: "failedbuild")  # a fresh build dir
    build = kernels.build_cpu_kernels(tmp_path)
    assert (build.is_built, build.label, build.target) == (False, "off", kernels.kernel_target())
    assert build.error is not None
    assert build.error.startswith("RuntimeError: Error building extension")
    assert f"{tmp_path / 'no-such-compiler'}: not found" in build.error
    assert build.describe() == f"no C++ kernels, torch paths ({build.error})"


def test_a_built_library_is_loaded_as_it_is_and_a_broken_one_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build folder is named by all the build depends on: a library in it loads without
    torch's builder (setuptools, ninja); one that does not load goes to the builder."""
    import torch.utils.cpp_extension

    cache_dir = default_cache_dir()
    if not kernels.build_cpu_kernels(cache_dir).is_built:
        pytest.skip("no C++ kernels on this machine")
    built: list[str] = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda **kw: built.append(kw["build_directory"])
    )
    key = kernels.kernel_cache_key()
    name = f"prefixgate_kernels_{key}"
    kernels.load_extension(name, kernels.SOURCES, cache_dir / "kernels" / key)
    assert built == []
    (tmp_path / f"{name}.so").write_bytes(b"not a library")
    with caplog.at_level("WARNING", logger="engine.executor.kernels"):
        kernels.load_extension(name, kernels.SOURCES, tmp_path)
    assert built == [str(tmp_path)]
    assert "does not load" in caplog.text and "building it again" in caplog.text


def test_a_build_left_unfinished_by_a_killed_builder_does_not_stop_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's builder waits forever on the `lock` file a killed build leaves: under our
    flock that file can only be a dead builder's, and is removed before torch looks."""
    import torch.utils.cpp_extension

    (tmp_path / "lock").write_text("")
    seen: list[bool] = []
    monkeypatch.setattr(
        torch.utils.cpp_extension,
        "load",
        lambda **kw: seen.append((Path(kw["build_directory"]) / "lock").exists()),
    )
    with caplog.at_level("WARNING", logger="engine.executor.kernels"):
        kernels.load_extension("prefixgate_kernels_x", kernels.SOURCES, tmp_path)
    assert seen == [False]
    assert "left by a build that did not finish" in caplog.text


def test_a_second_builder_waits_for_the_first_and_loads_its_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two starts at once (two replicas, a test session's background build and its engine):
    the second waits on the first's flock, then finds the library built and does not build."""
    import threading
    import time

    import torch.utils.cpp_extension

    built = tmp_path / "prefixgate_kernels_x.so"
    calls: list[str] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append("build"))
    monkeypatch.setattr(kernels, "_loads", lambda path, quiet=False: path.is_file())
    first = kernels._builder_lock(tmp_path)
    first.__enter__()
    with caplog.at_level("INFO", logger="engine.executor.kernels"):
        second = threading.Thread(
            target=kernels.load_extension, args=("prefixgate_kernels_x", kernels.SOURCES, tmp_path)
        )
        second.start()
        deadline = time.monotonic() + 30
        while "waiting for another process's build" not in caplog.text:
            assert time.monotonic() < deadline and second.is_alive()
            time.sleep(0.01)
        built.write_bytes(b"")  # the first builder's result
        first.__exit__(None, None, None)
        second.join(30)
    assert not second.is_alive() and calls == []


def test_a_build_names_its_integer_dot_products_in_the_start_up_line() -> None:
    build = kernels.KernelBuild(
        "avx512", True, dot_products="amx+avx512-vnni", attention="amx-bf16"
    )
    assert build.describe().endswith(
        "; integer dot products on amx+avx512-vnni; bf16 attention on amx-bf16)"
    )
    assert build.label == "avx512"


def test_ninja_from_the_python_package_is_found_without_an_activated_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shutil

    import ninja

    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    kernels._put_ninja_on_path()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")


# The kernels' numeric tests (int4/int8 matmul, paged decode attention, the layer ops) run
# in-process against the build for this machine; the other instruction sets are built (in the
# background from the start of the session: tests/kernel_variants.py) and checked here, each
# in a process of its own (one build's ops per process).
KERNEL_TESTS = ("test_quantization.py", "test_attention.py", "test_layers.py")
# Installed pytest plugins those tests do not use: loading them took 6.5 of the subprocess's
# 19.6 s before its first test on the AVX2 EPYC.
UNUSED_PLUGINS = ("schemathesis", "langsmith_plugin", "hypothesispytest")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the build's wait and the kernel tests' run, each bounded below
@pytest.mark.parametrize("capability", sorted(kernel_variants.VARIANTS))
def test_other_instruction_set_builds_pass_the_kernel_tests(capability: str) -> None:
    import subprocess
    import sys

    torch_capability, march = kernel_variants.VARIANTS[capability]
    if torch.backends.cpu.get_cpu_capability() == torch_capability:
        pytest.skip(f"{capability} is this machine's own build, tested in-process")
    env = kernel_variants.variant_env(capability)
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    target = "avx2" if capability == "avx2" else "portable"
    assert probe.stdout.split() == [target, march or "no-march"]
    build = kernel_variants.build_of(capability)
    if build is not None:  # started at collection; the kernel tests would build it otherwise
        returncode, log = build.wait(timeout=540)
        assert returncode == 0, log[-4000:]
        assert f"ok: C++ kernels ({target}" in log
    here = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
        + [arg for plugin in UNUSED_PLUGINS for arg in ("-p", f"no:{plugin}")]
        + [str(here / name) for name in KERNEL_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1] and "failed" not in done.stdout


PROBE = (
    "from engine.executor import kernels\n"
    "flags = [f for f in kernels.compile_flags() if f.startswith('-march')]\n"
    "print(kernels.kernel_target(), flags[0] if flags else 'no-march')\n"
)
