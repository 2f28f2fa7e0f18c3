"""`prefixgate` command line: engine flags map one-to-one onto EngineConfig fields."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Sequence

from engine import (
    EngineConfig,
    EngineError,
    LLMEngine,
    SamplingParams,
    chat_prompt_ids,
    text_prompt_ids,
)

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
        default=None,
        help="token budget of one step (chunked prefill); default 128 on CPU, 2048 on CUDA",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--prefixes",
        dest="prefix_file",
        default=None,
        help="prefix registry YAML (watched and hot-reloaded)",
    )


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
        prefix_file=args.prefix_file,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXGATE_API_KEY"),
        help="required as a Bearer token (default: $PREFIXGATE_API_KEY)",
    )
    serve.add_argument(
        "--admin-api-key",
        default=os.environ.get("PREFIXGATE_ADMIN_API_KEY"),
        help="required by the registry admin routes",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests waiting to start before answering 429",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    serve.add_argument("--served-model-name", default=None)
    add_engine_args(serve)
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
        prompt_ids = text_prompt_ids(engine.tokenizer, args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = chat_prompt_ids(engine.tokenizer, messages)
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


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn; SIGTERM stops accepting, gives in-flight requests `--shutdown-grace`
    seconds, then the engine aborts the rest, and the process exits 0."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.server import DrainingServer, uvicorn_config

    config = GatewayConfig(
        engine=engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_waiting=args.max_waiting,
        shutdown_grace=args.shutdown_grace,
        served_model_name=args.served_model_name,
    )
    logger.info(
        "starting prefixgate on http://%s:%d (model %s, device %s, dtype %s)",
        args.host,
        args.port,
        args.model or "embedded SmolLM2-135M-Instruct",
        args.device,
        args.dtype,
    )
    failed = False

    def stop_on_failure() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    app = create_app(config, on_fatal=stop_on_failure)
    server = DrainingServer(
        uvicorn_config(app, args.host, args.port, args.shutdown_grace),
        app.state.gateway,
        args.shutdown_grace,
    )
    # uvicorn re-raises a signal it handled once its shutdown is over, so with the default
    # disposition the process would die of it (status 143) after a clean stop. A no-op
    # handler is what uvicorn restores and re-raises into: we return 0 instead.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 1 if failed or not server.started else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "generate":
            return generate(args)
    except EngineError as exc:
        logger.error("%s", exc)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
