"""`prefixgate serve | generate`: one process on uvicorn, or Ray Serve replicas.

This module sits above both `gateway` and `replicas`, so neither imports the other's way up:
the gateway serves one engine or a `ReplicaSet` without knowing which, and only here does
`--replicas N` (N > 1) or `--ray-address` reach for Ray.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from engine import EngineError
from gateway import cli
from gateway.config import GatewayConfig

logger = logging.getLogger("prefixgate")


def serve_on_ray(config: GatewayConfig) -> int:
    try:
        from replicas.app import serve_on_ray as run
    except ImportError as exc:
        raise ValueError(
            f"--replicas/--ray-address need Ray Serve ({exc}): pip install 'prefixgate[ray]'"
        ) from exc
    return run(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = cli.build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            config = cli.gateway_config_from_args(args)
            return serve_on_ray(config) if config.uses_ray else cli.serve(args, config)
        if args.command == "generate":
            return cli.generate(args)
    except (EngineError, ValueError) as exc:  # ValueError: a setting is refused (API keys)
        logger.error("%s", exc)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
