"""tools/plot_bench.py writes its PNGs from synthetic bench_serving.py sweep reports."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tools import plot_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _distribution(p50_ms: float) -> dict[str, float]:
    return {"mean": p50_ms, "p50": p50_ms, "p95": 2 * p50_ms, "p99": 3 * p50_ms}


def _report(label: str, scale: float, rates: list[float]) -> dict[str, Any]:
    rng = random.Random(label)
    steps = []
    for qps in rates:
        ttft_ms = 100 * scale * qps
        requests = [
            {"index": i, "status": "ok", "ttft_s": rng.uniform(0.5, 1.5) * ttft_ms / 1000}
            for i in range(20)
        ]
        requests.append({"index": 20, "status": "error", "ttft_s": None})
        summary = {"ttft_ms": _distribution(ttft_ms), "e2e_ms": _distribution(5 * ttft_ms)}
        steps.append({"qps": qps, "concurrency": None, "summary": summary, "requests": requests})
    steps.append({"qps": None, "concurrency": 4, "summary": {}, "requests": []})  # skipped
    return {"label": label, "settings": {"slo_latency": 2.0}, "steps": steps}


def _write(tmp_path: Path, reports: list[dict[str, Any]]) -> list[str]:
    paths = []
    for report in reports:
        path = tmp_path / f"{report['label']}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    return paths


def test_writes_the_three_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _write(
        tmp_path, [_report("prefixgate", 1, [0.5, 1, 2]), _report("llama.cpp", 3, [1, 2])]
    )
    out = tmp_path / "plots"
    assert plot_bench.main([*paths, "--out-dir", str(out), "--cdf-qps", "1"]) == 0
    names = ["e2e_p95_vs_qps.png", "ttft_cdf_qps1.png", "ttft_vs_qps.png"]
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert len(data) > 5000
    assert capsys.readouterr().out.count("wrote ") == 3


def test_labels_without_the_cdf_step_are_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _write(tmp_path, [_report("a", 1, [0.5, 1]), _report("b", 2, [2, 4])])
    out = tmp_path / "plots"
    assert plot_bench.main([*paths, "--out-dir", str(out), "--cdf-qps", "0.5", "--log-y"]) == 0
    assert (out / "ttft_cdf_qps0.5.png").stat().st_size > 0
    assert "b: no step at 0.5 QPS" in capsys.readouterr().out
    assert plot_bench.main([*paths, "--out-dir", str(tmp_path / "none"), "--cdf-qps", "8"]) == 0
    assert not (tmp_path / "none" / "ttft_cdf_qps8.png").exists()


def test_results_without_qps_steps_are_refused(tmp_path: Path) -> None:
    report = {"label": "c", "steps": [{"qps": None, "concurrency": 2, "summary": {}}]}
    [path] = _write(tmp_path, [report])
    assert plot_bench.main([path, "--out-dir", str(tmp_path / "plots")]) == 1
    assert not (tmp_path / "plots").exists()
