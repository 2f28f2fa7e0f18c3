"""The `prefixgate` command's parser (flags generated from GatewayConfig and EngineConfig by
flags.py) and its single-process commands: `serve` on uvicorn and `generate`. The command
itself (`prefixgate.cli`) sits above this package and `replicas`, and picks Ray Serve when
`--replicas` asks for it."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import uuid

from engine import (
    EngineConfig,
    LLMEngine,
    SamplingParams,
    chat_prompt_ids,
    text_prompt_ids,
)
from gateway.config import GatewayConfig
from gateway.flags import add_config_args, config_from_args

logger = logging.getLogger("prefixgate")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return config_from_args(
        GatewayConfig, args, skip=("engine",), engine=engine_config_from_args(args)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    add_config_args(serve, GatewayConfig, "server", skip=("engine",))
    add_config_args(serve, EngineConfig, "engine")
    gen = sub.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--system", default=None, help="system message")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_config_args(gen, EngineConfig, "engine")
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


def serve(args: argparse.Namespace, config: GatewayConfig) -> int:
    """Run uvicorn in this process; SIGTERM stops accepting, gives in-flight requests
    `--shutdown-grace` seconds, then the engine aborts the rest, and the process exits 0."""
    from gateway.app import create_app
    from gateway.server import DrainingServer, uvicorn_config

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
    keys = app.state.gateway.keys
    if not keys.is_empty:
        logger.info(
            "API keys (tenants, each its own prefix-cache scope): %s", ", ".join(keys.names)
        )
    server = DrainingServer(
        uvicorn_config(app, args.host, args.port, args.shutdown_grace, config.keep_alive_timeout),
        app.state.gateway,
        args.shutdown_grace,
    )
    # uvicorn re-raises a signal it handled once its shutdown is over, so with the default
    # disposition the process would die of it (status 143) after a clean stop. A no-op
    # handler is what uvicorn restores and re-raises into: we return 0 instead.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 1 if failed or not server.started else 0
