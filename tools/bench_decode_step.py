"""Single-stream decode, in-process: the engine's batch-1 step at a given context, next to the
bandwidth floor of its weight format; and a linear-layer sweep, quantized kernel vs dense GEMM.

    .venv/bin/python tools/bench_decode_step.py [--context 1000] [--steps 60] [--out r.json]
        [--config auto:auto:on:float32 ...]    # dtype:quantization:compile[:kv cache dtype]
    .venv/bin/python tools/bench_decode_step.py --linears          # quantized vs dense by rows

A step here is `LLMEngine.step()` with one running greedy request: scheduling, the forward,
sampling and detokenization, the same work a server's engine thread does per token. The floor
is the bytes every step must read (decoder linears and head as stored, plus the K/V of the
context) over the machine's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.config import default_cache_dir
from engine.core.cpu import cpu_features
from engine.executor.kernels import compile_flags, load_cpu_kernels
from engine.executor.models.layers import PackedLinear
from engine.executor.quantization import QuantizedLinear, quantize_weight
from tools.provenance import git_revision

DEFAULT_CONFIGS = ("auto:auto:on", "auto:none:on", "auto:none:off")


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of one large tensor copy (read + write counted as read bytes x 2)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of the linears a batch-1 step reads: codes and scales where the quantized kernel
    runs, the packed or plain weight elsewhere (a dense copy included where it serves)."""
    total = 0
    for module in engine.runner.model.modules():
        if isinstance(module, QuantizedLinear):  # its dense copy, where kept, is counted below
            total += module.num_weight_bytes if module.dense is None else 0
        elif isinstance(module, PackedLinear):
            total += module.packed_weight.nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes
    return total


def decode_step(config: str, context: int, steps: int) -> dict[str, Any]:
    dtype, quantization, compiled, *kv = config.split(":")
    engine = LLMEngine(
        EngineConfig(
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv[0] if kv else "auto",
            enable_compile=compiled == "on",
            kv_cache_memory=256 << 20,
            max_model_len=max(2048, context + steps + 16),
            enable_prefix_cache=False,
        )
    )
    prompt = [1000 + i % 20000 for i in range(context)]
    params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
    engine.add_request("bench", prompt, params)
    while not any(out.token_ids for out in engine.step()):
        pass
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request("bench")
    spec = engine.pool.spec
    kv_bytes = context * spec.bytes_per_block // spec.block_size
    return {
        "config": config,
        "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
        "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "decode_kernel": engine.runner.use_cpu_kernels,
        "context": context,
        "step_p50_ms": 1000 * statistics.median(times),
        "step_min_ms": 1000 * min(times),
        "weight_mb_per_step": weight_bytes_per_step(engine) / 1e6,
        "kv_mb_per_step": kv_bytes / 1e6,
    }


def linear_sweep(rows: tuple[int, ...], repeats: int = 10) -> list[dict[str, Any]]:
    """SmolLM2's four linear shapes x 30 distinct layers (weights not in cache): the quantized
    kernel (4-bit) against the prepacked dense GEMM in the compute dtype auto picks."""
    assert load_cpu_kernels(default_cache_dir()), "the C++ kernels did not build"
    dtype = torch.bfloat16 if cpu_features().has_native_bf16 else torch.float32
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    layers = []
    for _ in range(30):
        for k, n in shapes:
            linear = torch.nn.Linear(k, n, bias=False)
            quantized, weight = quantize_weight(linear.weight.detach(), 4, dtype)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            layers.append((QuantizedLinear((quantized,), None, None), PackedLinear(linear)))
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        row: dict[str, Any] = {"rows": m, "dense_dtype": str(dtype).removeprefix("torch.")}
        row["quantized_ms"] = _time_pass(layers, inputs, dense=False, repeats=repeats)
        row["dense_ms"] = _time_pass(layers, inputs, dense=True, repeats=repeats)
        results.append(row)
        print(json.dumps(row))
    return results


def _time_pass(
    layers: list[tuple[QuantizedLinear, PackedLinear]],
    inputs: dict[int, torch.Tensor],
    dense: bool,
    repeats: int,
) -> float:
    def one_pass() -> None:
        for quantized, packed in layers:
            x = inputs[packed.in_features]
            packed(x) if dense else quantized(x)

    one_pass()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="dtype:quantization:compile(on|off)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--linears", action="store_true", help="the quantized vs dense row sweep")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with torch.inference_mode():
        _run(args)


def _run(args: argparse.Namespace) -> None:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    report: dict[str, Any] = {
        "git": git_revision(),
        "cpu": cpu_features().describe(),
        "kernel_flags": " ".join(compile_flags()),  # what the C++ kernels are built for
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "copy_bandwidth_gb_s": copy_bandwidth() / 1e9,
    }
    print(json.dumps(report))
    if args.linears:
        report["linears"] = linear_sweep((1, 2, 4, 8, 16, 32, 64))
    else:
        report["steps"] = []
        for config in args.config or DEFAULT_CONFIGS:
            row = decode_step(config, args.context, args.steps)
            floor_bytes = 1e6 * (row["weight_mb_per_step"] + row["kv_mb_per_step"])
            row["bandwidth_floor_ms"] = 1000 * floor_bytes / (1e9 * report["copy_bandwidth_gb_s"])
            report["steps"].append(row)
            print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
