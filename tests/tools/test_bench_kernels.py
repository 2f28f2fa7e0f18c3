"""tools/bench_kernels.py: two revisions' kernels side by side, timed in turns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tools import bench_kernels


def test_turns_keep_each_calls_best_time_and_compare_the_outputs_bit_for_bit() -> None:
    one = torch.ones(3)
    best, same = bench_kernels.in_turns([lambda: one, lambda: one.clone()], rounds=3)
    assert same and len(best) == 2 and all(0 <= b < 1 for b in best)
    _, same = bench_kernels.in_turns([lambda: one, lambda: one + 2**-20], rounds=1)
    assert not same


def test_a_revisions_files_are_read_from_git_and_the_checkouts_from_disk() -> None:
    folder = bench_kernels.REPO / bench_kernels.KERNELS
    here = bench_kernels.kernel_files(None)
    assert here == sorted(p.name for p in folder.iterdir() if p.suffix in (".cpp", ".h"))
    assert {"register_ops.cpp", "ops.h", "vec.h", "quant_matmul.cpp"} <= set(here)
    assert (
        bench_kernels.source_text(None, "quant_matmul.cpp")
        == (folder / "quant_matmul.cpp").read_text()
    )
    assert "quant_matmul.cpp" in bench_kernels.kernel_files("HEAD")
    assert "TORCH_LIBRARY" in bench_kernels.source_text("HEAD", "register_ops.cpp")


def test_renaming_leaves_no_name_of_ours_for_two_builds_to_share() -> None:
    """Two builds in one process must not resolve each other's symbols: after renaming, no
    source names the `prefixgate` op library or any C++ namespace of that name."""
    texts = {
        name: bench_kernels.source_text(None, name) for name in bench_kernels.kernel_files(None)
    }
    out = {name: bench_kernels.renamed(text, "bench_x") for name, text in texts.items()}
    assert not [name for name, text in out.items() if re.search(r"\bprefixgate\b", text)]
    assert "TORCH_LIBRARY(bench_x," in out["register_ops.cpp"]
    assert "namespace bench_x::ops {" in out["quant_matmul.cpp"]
    assert "namespace bench_x::qmm {" in out["quant_matmul_kernel.h"]
    assert "bench_x::amx_ready()" in out["paged_attention.cpp"]
    assert "PREFIXGATE_QMM_WIDTH(" in out["quant_matmul_kernel.h"]  # macros keep their names


@pytest.mark.bench
def test_the_report_times_both_builds_on_every_shape(
    tmp_path: Path,
) -> None:
    """The int4 linears only (both builds compile every kernel source: ~90 s each on 2
    cores; the attention kernel takes the same renaming)."""
    out = tmp_path / "r.json"
    report = bench_kernels.main(
        ["--rows", "3,7", "--tokens", "0", "--rounds", "1", "--out", str(out)]
    )
    assert [entry["rows"] for entry in report["linears"]] == [3, 7]  # type: ignore[index]
    assert report["attention"] == []
    for entry in report["linears"]:  # type: ignore[attr-defined]
        assert len(entry["ms"]) == 2 and all(ms > 0 for ms in entry["ms"])
        assert entry["same_bits"] is True  # this session's kernel changes no result of HEAD's
    assert out.read_text().startswith("{")
