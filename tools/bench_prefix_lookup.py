"""Admission's prefix lookup against the size of the registry (issue 11: flat from 1 to 10,000
registered prefixes).

    .venv/bin/python tools/bench_prefix_lookup.py [--prompt-tokens 1000] [--out r.json]

What admission does for a fresh prompt before it can share blocks: hash the prompt's blocks in
its own scope and in the registry scope, find the longest whole registered prefix
(PrefixIndex), the longest run of registry blocks and of its own scope's cached blocks
(KVCacheManager.best_cached). The registry holds N prefixes of 64 to 512 tokens over a BlockPool
of 1-element KV blocks (the lookup never reads KV), so N = 10,000 fits in memory. The old
registry matched by scanning every entry: its cost is measured beside it for comparison.
No model is loaded; the figures are CPU time on this machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.kvcache.block_pool import BlockPool, KVCacheSpec
from engine.kvcache.manager import KVCacheManager
from engine.registry.registry import PrefixRegistry, RegisteredPrefix
from engine.registry.spec import PrefixSpec
from tools.provenance import git_revision

BLOCK = 16
COUNTS = (1, 100, 10_000)


def _registry(
    num_prefixes: int, rng: random.Random
) -> tuple[KVCacheManager, list[tuple[int, ...]]]:
    lengths = [rng.randrange(64, 513) for _ in range(num_prefixes)]
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 4096
    spec = KVCacheSpec(1, 1, 1, BLOCK, torch.float32)
    pool = BlockPool(spec, num_blocks)
    registry = PrefixRegistry(pool)
    prefixes = {}
    token_lists = []
    for index, length in enumerate(lengths):
        ids = tuple(rng.randrange(49_152) for _ in range(length))
        token_lists.append(ids)
        blocks = pool.allocate(-(-length // BLOCK))
        pool.pin(blocks)
        spec_ = PrefixSpec(f"p{index}", "", "text", (), "x", ids)
        prefixes[spec_.name] = RegisteredPrefix(spec_, blocks, torch.zeros(1), BLOCK)
    registry.install(prefixes)
    return KVCacheManager(pool, True, registry), token_lists


def _linear_match(token_lists: list[tuple[int, ...]], prompt: list[int]) -> int:
    """The registry's match before issue 11: every entry compared."""
    best = 0
    for ids in token_lists:
        if len(ids) <= len(prompt) and len(ids) > best and tuple(prompt[: len(ids)]) == ids:
            best = len(ids)
    return best


def _time_us(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for count in COUNTS:
        rng = random.Random(count)
        cache, token_lists = _registry(count, rng)
        hit = list(token_lists[count // 2])
        prompt = hit + [rng.randrange(49_152) for _ in range(args.prompt_tokens - len(hit))]

        def lookup(prompt: list[int] = prompt, cache: KVCacheManager = cache) -> None:
            seq = Sequence("bench", list(prompt), len(prompt), SamplingParams(), 0)
            match, best = cache.best_cached(seq)
            assert match is not None and best is not None and best.source == "registry"

        rows.append(
            {
                "registered_prefixes": count,
                "lookup_us": round(_time_us(lookup, args.repeats), 1),
                "linear_scan_us": round(
                    _time_us(functools.partial(_linear_match, token_lists, prompt), args.repeats),
                    1,
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": "prefix lookup at admission",
        "git_revision": git_revision(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "prompt_tokens": args.prompt_tokens,
        "block_size": BLOCK,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
