"""tools/bench_prefill.py on the tiny Llama: a report per run, each run a prompt of its own."""

from __future__ import annotations

from pathlib import Path

from tools import bench_prefill


def test_the_report_lists_every_run_of_a_distinct_prompt(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    report = bench_prefill.main(
        ["--tokens", "40", "--runs", "3", "--model", str(tiny_llama_path), "--out", str(out)]
    )
    assert len(report["tokens_per_s"]) == 3  # type: ignore[arg-type]
    assert report["median_tokens_per_s"] > 0  # type: ignore[operator]
    assert out.read_text().startswith("{")
    prompts = [bench_prefill.prompt_ids(40, run, 512) for run in range(3)]
    assert len({tuple(p) for p in prompts}) == 3 and all(100 <= i < 512 for p in prompts for i in p)
