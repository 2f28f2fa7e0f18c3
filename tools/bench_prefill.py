"""Prefill speed, in-process: one uncached prompt computed in one step, as tokens per second.

    .venv/bin/python tools/bench_prefill.py [--tokens 1000] [--runs 6] [--model PATH] [--out r.json]
    .venv/bin/python tools/bench_prefill.py --llama-cpp http://127.0.0.1:8081   # the peer

Each run adds a fresh prompt (distinct ids, so nothing is reused: the prefix cache is off too)
with `max_tokens: 1` and steps the engine until it finishes: the step is the whole prompt's
forward plus one sampled token. The first run warms up; the median is over the others. Prints
and (with --out) writes one JSON object with the git revision and the CPU capability.
`--llama-cpp URL`: the same prompts (as token ids) sent to a llama.cpp server's `/completion`
with `cache_prompt: false` and `n_predict: 1` (`tools/peers.py start llama-cpp`), timed the
same way from the client, with the server's own `prompt_per_second` beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import EngineConfig, LLMEngine, SamplingParams
from tools.provenance import git_revision, write_report


def prompt_ids(num_tokens: int, run: int, vocab_size: int) -> list[int]:
    """Ids spread over the vocabulary, different for every run."""
    return [(i * 7919 + run * 104729) % (vocab_size - 100) + 100 for i in range(num_tokens)]


def measure(engine: LLMEngine, num_tokens: int, runs: int) -> list[float]:
    """Seconds per run, each a whole `num_tokens` prompt in one step."""
    seconds = []
    for run in range(runs):
        engine.add_request(
            f"prefill-{run}",
            prompt_ids(num_tokens, run, engine.vocab_size),
            SamplingParams(temperature=0, max_tokens=1),
        )
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure_llama_cpp(url: str, num_tokens: int, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per run from the client, and the server's own prompt tokens per second."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        vocab_size = int(json.load(response)["data"][0]["meta"]["n_vocab"])
    seconds, server_rates = [], []
    for run in range(runs):
        body = {
            "prompt": prompt_ids(num_tokens, run, vocab_size),
            "n_predict": 1,
            "cache_prompt": False,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.load(response)
        seconds.append(time.perf_counter() - started)
        server_rates.append(float(answer["timings"]["prompt_per_second"]))
    return seconds, server_rates


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--llama-cpp", default=None, help="a llama.cpp server's URL instead")
    args = parser.parse_args(argv)
    if args.llama_cpp is not None:
        seconds, rates = measure_llama_cpp(args.llama_cpp.rstrip("/"), args.tokens, args.runs)
        peer: dict[str, object] = {
            "git": git_revision(),
            "system": f"llama.cpp server at {args.llama_cpp}",
            "tokens": args.tokens,
            "tokens_per_s": [round(args.tokens / s, 1) for s in seconds],
            "median_tokens_per_s": round(
                args.tokens / statistics.median(seconds[1:] or seconds), 1
            ),
            "server_prompt_per_second": [round(r, 1) for r in rates],
        }
        write_report(peer, args.out)
        return peer
    settings = {"enable_prefix_cache": False, "max_num_batched_tokens": args.tokens}
    if args.model is not None:
        settings["model"] = args.model
    engine = LLMEngine(EngineConfig(max_model_len=args.tokens + 8, **settings))
    seconds = measure(engine, args.tokens, args.runs)
    measured = seconds[1:] or seconds
    report: dict[str, object] = {
        "git": git_revision(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "tokens_per_s": [round(args.tokens / s, 1) for s in seconds],
        "median_tokens_per_s": round(args.tokens / statistics.median(measured), 1),
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
