"""The C++ kernels of this checkout against those of another git revision, in one process,
timed in turns.

    .venv/bin/python tools/bench_kernels.py [--against HEAD] [--rows 1,16,1000] [--tokens 1000]
        [--rounds 20] [--out r.json]

Why: on a shared 2-core VM the same kernel's speed drifts by 30% or more from one minute to
the next, so two runs of a benchmark, one per build, compare the machine's moods more than the
code. Here both builds are loaded side by side (each revision's kernel sources and headers,
compiled into an op namespace and a C++ namespace of their own) and every
round times each build once on the same inputs; the best round of each is reported. The two
builds' outputs are compared bit for bit too ("same_bits"): a blocking or scheduling change
must not move a result.

Shapes: SmolLM2-135M's four linears (q/k/v fused 960 x 576, o 576 x 576, gate/up fused
3072 x 576, down 576 x 1536) as int4 at each row count of --rows, and its attention (9 query
heads over 3 KV heads of 64) for a prefill of --tokens tokens, the last --suffix queries of
that context (a user turn after a registry hit), one decode query, and decode batches of
--decodes sequences sharing the context's first 15/16 (the registry prefix), in the dtypes
the engine picks here (`--dtype auto`: bf16 queries over a bf16 cache on CPUs with native
bf16, whose AMX tiles then serve them; float32 over float16 elsewhere). Prints and (with
--out) writes one JSON object.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.config import default_cache_dir
from engine.core.cpu import auto_dtype
from engine.executor.kernels import build_key, compile_flags, load_extension
from engine.executor.quantization import quantize_weight
from tools.provenance import REPO, git_revision, write_report

KERNELS = Path("engine/executor/kernels")
LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def kernel_files(revision: str | None) -> list[str]:
    """The kernel folder's sources and headers, as this checkout has them (None) or as
    `revision` had them (the set changed: register_ops.cpp and ops.h came in 2026-11)."""
    if revision is None:
        names = [path.name for path in (REPO / KERNELS).iterdir()]
    else:
        names = subprocess.check_output(
            ["git", "ls-tree", "--name-only", f"{revision}:{KERNELS}"], cwd=REPO, text=True
        ).split()
    return sorted(name for name in names if name.endswith((".cpp", ".h")))


def source_text(revision: str | None, name: str) -> str:
    """A kernel file as this checkout has it (None) or as `revision` had it."""
    if revision is None:
        return (REPO / KERNELS / name).read_text()
    return subprocess.check_output(
        ["git", "show", f"{revision}:{KERNELS / name}"], cwd=REPO, text=True
    )


def renamed(text: str, namespace: str) -> str:
    """A kernel source with every `prefixgate` name (not PREFIXGATE_ macros) in `namespace`."""
    return re.sub(r"\bprefixgate\b", namespace, text)


def build(revision: str | None) -> object:
    """The revision's kernels as torch.ops.<namespace>, built once per `build_key`. Every
    `prefixgate` name of the sources is renamed to that namespace (the op library and the
    C++ namespaces of the entry points, the kernels and their helpers), so that neither
    library's symbols can stand in for the other's."""
    texts = {name: source_text(revision, name) for name in kernel_files(revision)}
    namespace = f"bench_{build_key([text.encode() for text in texts.values()])[:12]}"
    folder = default_cache_dir() / "bench_kernels" / namespace
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / name).write_text(renamed(text, namespace))
    sources = tuple(folder / name for name in texts if name.endswith(".cpp"))
    load_extension(namespace, sources, folder, (folder,))
    return getattr(torch.ops, namespace)


def in_turns(calls: list[Callable[[], torch.Tensor]], rounds: int) -> tuple[list[float], bool]:
    """Best seconds of each call over `rounds` rounds (each round runs every call once), and
    whether all calls gave the same bits."""
    outputs = [call() for call in calls]
    same = all(torch.equal(outputs[0], out) for out in outputs[1:])
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best, same


def linears(ops: list[object], rows: int, rounds: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(rows)
    seconds = [0.0] * len(ops)
    same = True
    for n, k in LINEARS:
        weight, _ = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, 4)
        x = torch.randn(rows, k, generator=gen)
        calls = [partial(op.quant_matmul, x, weight.codes, weight.scales, 4, n) for op in ops]  # type: ignore[attr-defined]
        best, equal = in_turns(calls, rounds)
        seconds = [total + b for total, b in zip(seconds, best, strict=True)]
        same = same and equal
    macs = rows * sum(n * k for n, k in LINEARS)
    return {
        "rows": rows,
        "ms": [round(s * 1e3, 3) for s in seconds],
        "gmac_per_s": [round(macs / s / 1e9, 1) for s in seconds],
        "same_bits": same,
    }


def attention_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """(query, cache) dtypes: bf16 over bf16, float32 over float16, or what the engine picks."""
    compute = auto_dtype(torch.device("cpu")) if name == "auto" else getattr(torch, name)
    return compute, torch.bfloat16 if compute == torch.bfloat16 else torch.float16


def attention(
    ops: list[object], tokens: int, queries: int, rounds: int, dtypes: tuple[torch.dtype, ...]
) -> dict[str, object]:
    """The last `queries` positions of a `tokens`-token sequence (all of them: a prefill)."""
    gen = torch.Generator().manual_seed(tokens + queries)
    blocks = (tokens + BLOCK - 1) // BLOCK
    q_dtype, kv_dtype = dtypes
    k_cache = torch.randn(blocks + 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype)
    v_cache = torch.randn(blocks + 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype)
    q = torch.randn(queries, HEADS, HEAD_DIM, generator=gen).to(q_dtype)
    tables = torch.randperm(blocks + 2, generator=gen)[:blocks][None].long()
    rows = torch.zeros(queries, dtype=torch.long)
    positions = torch.arange(tokens - queries, tokens)
    calls = []
    for op in ops:
        plan = op.attention_plan(tables, rows, positions, BLOCK)  # type: ignore[attr-defined]
        calls.append(
            partial(
                op.paged_attention,  # type: ignore[attr-defined]
                q,
                k_cache,
                v_cache,
                tables,
                rows,
                positions,
                *plan,
                HEAD_DIM**-0.5,
            )
        )
    best, same = in_turns(calls, rounds)
    keys = positions.add(1).sum().item()
    shape = {"tokens": tokens, "queries": queries}
    return shape | _timings(dtypes, best, 2 * HEADS * HEAD_DIM * keys, same)


def _timings(
    dtypes: tuple[torch.dtype, ...], best: list[float], macs: int, same: bool
) -> dict[str, object]:
    """An attention entry's dtypes, ms and rates per build, and whether the bits agreed."""
    return {
        "dtypes": [str(dtype).removeprefix("torch.") for dtype in dtypes],
        "ms": [round(s * 1e3, 3) for s in best],
        "gmac_per_s": [round(macs / s / 1e9, 1) for s in best],
        "same_bits": same,
    }


def shared_decodes(
    ops: list[object],
    tokens: int,
    batch: int,
    rounds: int,
    dtypes: tuple[torch.dtype, ...],
    layers: int = 30,
) -> dict[str, object]:
    """One decode query each of `batch` sequences at `tokens` tokens of context whose first
    ~94% (the registry prefix of an `intent` turn: 937 of ~1000) are the same blocks, the
    rest their own: a decode step of the `intent` workload at concurrency `batch`, over
    `layers` layers' caches in turn (SmolLM2's 30: a step's K/V are not in L2, as in the
    engine, where one layer's cache over and over measured ~30% quicker). ms a layer."""
    gen = torch.Generator().manual_seed(tokens * batch)
    shared = tokens * 15 // 16 // BLOCK
    own = (tokens + BLOCK - 1) // BLOCK - shared
    num_blocks = shared + batch * own
    q_dtype, kv_dtype = dtypes
    shape = (layers, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_caches = torch.randn(*shape, generator=gen).to(kv_dtype)
    v_caches = torch.randn(*shape, generator=gen).to(kv_dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(q_dtype)
    tables = torch.tensor(
        [list(range(shared)) + [shared + b * own + i for i in range(own)] for b in range(batch)]
    )
    rows = torch.arange(batch)
    positions = torch.full((batch,), tokens - 1)

    def step(op: object) -> torch.Tensor:
        plan = op.attention_plan(tables, rows, positions, BLOCK)  # type: ignore[attr-defined]
        outs = [
            op.paged_attention(  # type: ignore[attr-defined]
                q, k, v, tables, rows, positions, *plan, HEAD_DIM**-0.5
            )
            for k, v in zip(k_caches, v_caches, strict=True)
        ]
        return torch.stack(outs)

    best, same = in_turns([partial(step, op) for op in ops], rounds)
    best = [b / layers for b in best]
    shape = {"tokens": tokens, "decodes": batch, "layers": layers}
    return shape | _timings(dtypes, best, 2 * HEADS * HEAD_DIM * tokens * batch, same)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="git revision to compare with")
    parser.add_argument("--rows", default="1,16,1000", help="linear row counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=1000, help="attention context (0: none)")
    parser.add_argument("--suffix", type=int, default=100, help="a suffix's queries (0: none)")
    parser.add_argument(
        "--decodes",
        default="8,16",
        help="decode batches sharing a prefix, comma-separated (empty: none)",
    )
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="attention's"
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    against = subprocess.check_output(
        ["git", "rev-parse", "--short", args.against], cwd=REPO, text=True
    ).strip()
    ops = [build(against), build(None)]
    report: dict[str, object] = {
        "builds": [against, f"{git_revision()} + working tree"],
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "flags": compile_flags(),
        "threads": torch.get_num_threads(),
        "linears": [
            # small calls are short: more rounds, for as many chances at a quiet moment
            linears(ops, int(rows), args.rounds * max(1, min(100, 1000 // int(rows))))
            for rows in args.rows.split(",")
        ],
        "attention": [
            attention(ops, args.tokens, queries, rounds, attention_dtypes(args.dtype))
            for queries, rounds in (
                (args.tokens, args.rounds),
                (args.suffix, args.rounds * 3),
                (1, args.rounds * 10),
            )
            if 0 < queries <= args.tokens
        ],
        "shared_decodes": [
            shared_decodes(ops, args.tokens, int(batch), args.rounds, attention_dtypes(args.dtype))
            for batch in args.decodes.split(",")
            if batch and args.tokens > 0
        ],
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
