"""How much of a decode step is host-side work: everything outside the model's forward (and
the kernels it calls) and its LM head, at batch 1, 8 and 32, in-process.

    .venv/bin/python tools/bench_host_share.py [--batch 1 --batch 8 --batch 32] [--steps 40]
        [--baseline-tree /tmp/before] [--rounds 3] [--out r.json]

A step is what the server's engine thread runs per step with `batch` greedy requests all
decoding (short distinct prompts, `ignore_eos`): `LLMEngine.step_tokens()` where the engine
has it (its text is made on the event loop since), else `LLMEngine.step()` (which
detokenized on that thread): scheduling, building the batch, the forward, sampling,
appending each token. The forward is timed around the model's own call and
`compute_logits`; the host share is (step - forward) / step, medians over the steps.

`--baseline-tree DIR` measures another checkout of the project (say `git worktree add
/tmp/before REV`) in the same run: each round runs the baseline and this tree one after the
other, each in its own process, so both see the same machine state. The measurement uses the
engine's public API only (`LLMEngine`, `EngineConfig`, `SamplingParams`, `engine.runner.model`,
`engine.step()`), which both layouts have.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def measure(batch: int, steps: int) -> dict[str, Any]:
    """One engine, `batch` sequences decoding; medians of the step and forward times."""
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(enable_prefix_cache=False, max_model_len=1024, kv_cache_memory=256 << 20)
    engine = LLMEngine(config)
    model = engine.runner.model
    forward_seconds: list[float] = []

    class Timed:
        """The model, with its forward and LM head timed (everything else passes through)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

        def __call__(self, *args: Any) -> Any:
            return _timed(model, args, forward_seconds)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return _timed(model.compute_logits, (hidden,), forward_seconds)  # type: ignore[no-any-return]

    engine.runner.model = Timed()  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        prompt = [1 + (i * 7 + j * 13) % 5000 for j in range(24)]
        engine.add_request(f"r{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    step = getattr(engine, "step_tokens", engine.step)  # the engine thread's step
    for _ in range(5):  # warm
        step()
    step_times, forward_times = [], []
    for _ in range(steps):
        forward_seconds.clear()
        start = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - start)
        forward_times.append(sum(forward_seconds))
    host = [s - f for s, f in zip(step_times, forward_times, strict=True)]
    step_p50 = statistics.median(step_times)
    return {
        "step": step.__name__,
        "batch": batch,
        "steps": steps,
        "step_ms_p50": 1e3 * step_p50,
        "step_ms_min": 1e3 * min(step_times),
        "forward_ms_p50": 1e3 * statistics.median(forward_times),
        "host_ms_p50": 1e3 * statistics.median(host),
        "host_share_p50": statistics.median(h / s for h, s in zip(host, step_times, strict=True)),
    }


def _timed(fn: Any, args: tuple[Any, ...], sink: list[float]) -> Any:
    start = time.perf_counter()
    result = fn(*args)
    sink.append(time.perf_counter() - start)
    return result


def run_tree(tree: Path, batches: list[int], steps: int) -> dict[str, Any]:
    """Measure in a fresh process whose `engine` package comes from `tree`."""
    code = (
        "import importlib.util, json, sys\n"
        f"sys.path.insert(0, {str(tree)!r})\n"
        f"spec = importlib.util.spec_from_file_location('bench', {__file__!r})\n"
        "bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)\n"
        f"rows = [bench.measure(b, {steps}) for b in {batches!r}]\n"
        "print(json.dumps({'system': bench.describe(), 'rows': rows}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["tree"] = str(tree)
    result["git"] = _git(tree)
    return result


def describe() -> dict[str, Any]:
    import platform

    import torch

    import engine

    return {
        "engine_from": str(Path(engine.__file__).parent),
        "cpu": _cpu_model(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _git(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batches = args.batch or [1, 8, 32]
    trees = ([args.baseline_tree] if args.baseline_tree else []) + [REPO]
    runs = [run_tree(tree, batches, args.steps) for _ in range(args.rounds) for tree in trees]
    for run in runs:
        print(f"{run['git']} ({run['system']['engine_from']}, {run['system']['torch_capability']})")
        for row in run["rows"]:
            print(
                "  batch {batch:>2}: step p50 {step_ms_p50:6.2f} ms (min {step_ms_min:6.2f}), "
                "forward {forward_ms_p50:6.2f}, host {host_ms_p50:5.2f} ms = "
                "{host_share_p50:.1%}".format(**row)
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": sys.argv, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
