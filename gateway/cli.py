"""`prefixgate` command line: engine flags map one-to-one onto EngineConfig fields."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import uuid
from collections.abc import Sequence

from engine import EngineConfig, EngineError, LLMEngine, SamplingParams

logger = logging.getLogger("prefixgate")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1.5g', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV pool size in bytes, e.g. 2GiB (default: 20%% of RAM, at most 4 GiB)",
    )
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget of one step (chunked prefill)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_cache=args.enable_prefix_cache,
        num_threads=args.num_threads,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--system", default=None, help="system message")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(gen)
    return parser


def generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    if args.raw:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sample_seed,
    )
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, list(prompt_ids), params)
    start, first, num_tokens = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            first = first or time.perf_counter()
            num_tokens = output.num_completion_tokens
            sys.stdout.write(output.text)
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    logger.info(
        "%d prompt tokens, %d generated; first token %.3f s, %.1f tokens/s after it",
        len(prompt_ids),
        num_tokens,
        (first or end) - start,
        (num_tokens - 1) / max(end - (first or end), 1e-9),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            return generate(args)
    except EngineError as exc:
        logger.error("%s", exc)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
