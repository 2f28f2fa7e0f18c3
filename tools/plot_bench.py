"""Plots from tools/bench_serving.py sweep results (one JSON per system/config).

    .venv/bin/python tools/plot_bench.py results/*.json --out-dir docs/plots [--cdf-qps 1]

Writes, one line per result label:
  ttft_vs_qps.png       TTFT p50 and p95 (s) against the offered QPS;
  e2e_p95_vs_qps.png    end-to-end latency p95 (s) against QPS, the SLO as a dashed line;
  ttft_cdf_qps<X>.png   the CDF of per-request TTFT at the step whose QPS is --cdf-qps.
Only steps run at a QPS are plotted (a fixed-concurrency run has no QPS axis).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: files only, no display

import matplotlib.pyplot as plt


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Each file's label and its QPS steps, sorted by QPS."""
    results = []
    for path in paths:
        report = json.loads(path.read_text())
        steps = sorted((s for s in report["steps"] if s["qps"] is not None), key=_qps)
        results.append({"label": report["label"], "steps": steps, "report": report})
    return results


def _qps(step: dict[str, Any]) -> float:
    return float(step["qps"])


def _seconds(step: dict[str, Any], metric: str, stat: str) -> float:
    value = step["summary"][metric][stat]
    return float("nan") if value is None else value / 1000


def plot_ttft(results: list[dict[str, Any]], out: Path, log_y: bool) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, stat in zip(axes, ("p50", "p95"), strict=True):
        for result in results:
            steps = result["steps"]
            ys = [_seconds(s, "ttft_ms", stat) for s in steps]
            ax.plot([_qps(s) for s in steps], ys, marker="o", label=result["label"])
        ax.set_title(f"TTFT {stat} vs offered load")
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(True, alpha=0.3)
        if log_y:
            ax.set_yscale("log")
    axes[0].set_ylabel("time to first token (s)")
    axes[1].legend(title="system")
    return _save(fig, out / "ttft_vs_qps.png")


def plot_e2e(results: list[dict[str, Any]], out: Path, slo_s: float, log_y: bool) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for result in results:
        steps = result["steps"]
        ys = [_seconds(s, "e2e_ms", "p95") for s in steps]
        ax.plot([_qps(s) for s in steps], ys, marker="o", label=result["label"])
    ax.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax.set_title("End-to-end latency p95 vs offered load")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("end-to-end latency p95 (s)")
    ax.grid(True, alpha=0.3)
    if log_y:
        ax.set_yscale("log")
    ax.legend(title="system")
    return _save(fig, out / "e2e_p95_vs_qps.png")


def plot_ttft_cdf(results: list[dict[str, Any]], out: Path, qps: float) -> Path | None:
    """CDF of the completed requests' TTFT at the step run at `qps`; None if no result has
    such a step."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    plotted = False
    for result in results:
        step = next((s for s in result["steps"] if abs(_qps(s) - qps) < 1e-9), None)
        if step is None:
            print(f"{result['label']}: no step at {qps:g} QPS, left out of the CDF")
            continue
        ttfts = sorted(r["ttft_s"] for r in step["requests"] if r["ttft_s"] is not None)
        if ttfts:
            fractions = [i / len(ttfts) for i in range(len(ttfts) + 1)]
            xs = [ttfts[0], *ttfts]  # from 0 at the fastest request to 1 at the slowest
            ax.step(xs, fractions, where="post", label=f"{result['label']} (n={len(ttfts)})")
            plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_title(f"TTFT distribution at {qps:g} requests/s")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(title="system")
    return _save(fig, out / f"ttft_cdf_qps{qps:g}.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _slo(results: list[dict[str, Any]], override: float | None) -> float:
    if override is not None:
        return override
    for result in results:
        slo = result["report"].get("settings", {}).get("slo_latency")
        if slo is not None:
            return float(slo)
    return 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path, help="bench_serving.py JSON reports")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/plots"), help="PNG folder")
    parser.add_argument("--cdf-qps", type=float, default=1.0, help="QPS step of the TTFT CDF")
    parser.add_argument(
        "--slo-latency", type=float, help="SLO line (s); default: the first result's setting"
    )
    parser.add_argument("--log-y", action="store_true", help="logarithmic latency axes")
    args = parser.parse_args(argv)

    results = load_results(args.results)
    if not any(r["steps"] for r in results):
        print("no QPS steps in these results (run bench_serving.py with --qps/--sweep-qps)")
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        plot_ttft(results, args.out_dir, args.log_y),
        plot_e2e(results, args.out_dir, _slo(results, args.slo_latency), args.log_y),
        plot_ttft_cdf(results, args.out_dir, args.cdf_qps),
    ]
    for path in written:
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
