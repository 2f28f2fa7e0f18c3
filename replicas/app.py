"""The Ray Serve application: an ingress deployment serving the OpenAI routes in front of an
engine deployment of N replicas.

The ingress runs the same Starlette app as the single-process server (auth, validation,
errors, SSE, /health, /metrics, the registry admin routes), with a `ReplicaSet` as its
engine. The engine deployment routes with `PreferredReplicaRouter`.

Three ways in:
- `prefixgate serve --replicas N [--ray-address ADDR]`: `serve_on_ray` below;
- `serve run deploy/serve.yaml`: Serve imports `app_builder` with the file's `args`, which
  are `prefixgate serve` flags without their dashes (`replicas: 2`, `prefixes: ...`);
- a KubeRay RayService: the same config inside its manifest (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from engine import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tenants import KeyRing
from replicas.client import ReplicaSet
from replicas.replica import EngineReplica
from replicas.router import PreferredReplicaRouter
from replicas.spare_worker import ACTOR_RUNTIME_ENV, PRELOAD_MODULES, keep_spare_workers

logger = logging.getLogger(__name__)
APP_NAME = "prefixgate"


# Serve's default of 5 requests at a time per replica would queue the sixth HTTP request in
# the proxy: the ingress admits what the gateway admits (--max-waiting, then 429).
INGRESS_MAX_ONGOING_REQUESTS = 100_000


@serve.deployment(
    name="ingress",
    ray_actor_options={"num_cpus": 0, "runtime_env": ACTOR_RUNTIME_ENV},
    max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
)
@serve.ingress()
class Ingress:
    def __init__(self, config: GatewayConfig, engine: DeploymentHandle[Any]) -> None:
        self._app = create_app(
            config,
            connect=lambda: ReplicaSet(
                engine,
                config.replicas,
                request_timeout=config.replica_timeout,
                affinity_slack=config.affinity_slack,
            ),
        )

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._app

    def check_health(self) -> None:
        """Serve restarts an ingress whose connection to the replicas failed for good (a
        replica's facts that do not unpickle, say: faults and silence are retried)."""
        error = self._app.state.gateway.load_error
        if error is not None:
            raise RuntimeError(f"ingress: connecting to the engine replicas failed: {error}")


def build_app(config: GatewayConfig) -> Application:
    """The application for `config`: paths made absolute (replicas may start elsewhere),
    torch threads set (`replica_threads`), the API keys' names told (`KeyRing.serving`)."""
    engine_config = KeyRing(config.api_keys, config.api_key_file).serving(
        _absolute_paths(config.engine)
    )
    if engine_config.num_threads is None:
        engine_config = dataclasses.replace(engine_config, num_threads=replica_threads(config))
    logger.info(
        "engine replicas: %d, %d torch threads each", config.replicas, engine_config.num_threads
    )
    config = dataclasses.replace(config, engine=engine_config)
    engine = serve.deployment(
        name="engine",
        num_replicas=config.replicas,
        # Serve's own queue bound: the engine queues past its batch, the gateway 429s first.
        max_ongoing_requests=config.max_waiting + config.engine.max_num_seqs,
        # Serve finds a dead replica at its next health check: 0.5 s keeps that part of a
        # replacement short (the check itself only reads a flag).
        health_check_period_s=0.5,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=config.shutdown_grace,
        ray_actor_options={"num_cpus": config.replica_cpus, "runtime_env": ACTOR_RUNTIME_ENV},
        # The ingress polls every replica twice a second: an access log line per poll is noise.
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=PreferredReplicaRouter  # type: ignore[arg-type]
        ),
    )(EngineReplica).bind(config.engine, config.stream_interval)
    ingress = Ingress.options(  # type: ignore[attr-defined]
        graceful_shutdown_timeout_s=config.shutdown_grace
    )
    return ingress.bind(config, engine)  # type: ignore[no-any-return]


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run`'s entry: `args` are `prefixgate serve` flags, `replicas: 2` for
    `--replicas 2`, `true` for a switch, a list for a repeatable flag."""
    return build_app(config_from_serve_args(args))


def config_from_serve_args(args: dict[str, Any]) -> GatewayConfig:
    """Raises ValueError with argparse's reason (argparse would exit Serve's builder
    instead)."""
    from gateway.cli import build_parser, gateway_config_from_args

    argv = ["serve"]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            if item is True:
                argv.append(flag)
            elif item is not False and item is not None:
                argv += [flag, str(item)]
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):
            namespace = build_parser().parse_args(argv)
    except SystemExit:  # argparse wrote why (its last line) and exited
        why = refusal.getvalue().strip().splitlines()[-1]
        raise ValueError(f"serve args {args!r}: {why}") from None
    return gateway_config_from_args(namespace)


# A cluster we start imports replicas.preload into every worker process it starts, before the
# worker takes an actor; ours then import the package (see replicas/spare_worker.py, which
# keeps one such worker spare).
OWN_CLUSTER: dict[str, Any] = {
    "enable_worker_prestart": True,
    "preload_python_modules": PRELOAD_MODULES,
}


def serve_on_ray(config: GatewayConfig) -> int:
    """Start (or join, with `ray_address`) Ray, run the application with Serve's HTTP proxy
    on `host:port`, and keep it up until SIGTERM or SIGINT; then shut Serve down. A signal
    while the replicas still load (minutes, for a big model) stops the start-up too."""
    import ray

    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if not started.is_set():  # leave serve.run; the finally below shuts down
            raise KeyboardInterrupt

    # Ray's own RAY_ADDRESS (set for `ray job submit` entrypoints) names a cluster to join.
    address = config.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    starts_ray = address == "local"
    ray.init(
        address=address,
        include_dashboard=False,
        _system_config=OWN_CLUSTER if starts_ray else None,
    )
    # After ray.init, whose own SIGTERM handler (a log line, then abort) would run instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if starts_ray:  # a cluster we join keeps its workers as its operator chose
        keep_spare_workers(stop)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        logger.info(
            "Ray Serve: %d engine replicas behind http://%s:%d/v1 (loading...)",
            config.replicas,
            config.host,
            config.port,
        )
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        started.set()
        logger.info(
            "ready: http://%s:%d/v1 on %d replicas", config.host, config.port, config.replicas
        )
        stop.wait()
    except KeyboardInterrupt:
        logger.info("stopped while starting")
    finally:
        logger.info("stopping the Ray Serve application")
        started.set()  # a second signal must not interrupt the shutdown
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0


def replica_threads(config: GatewayConfig) -> int:
    """Torch threads per replica when --num-threads is not given. Ray starts workers with
    OMP_NUM_THREADS=1 unless they reserve CPUs, which halves a 2-core replica's speed: take
    the reserved CPUs, else this machine's cores shared by the replicas."""
    if config.replica_cpus >= 1:
        return int(config.replica_cpus)
    return max(1, (os.cpu_count() or 1) // config.replicas)


def _absolute_paths(engine: EngineConfig) -> EngineConfig:
    def absolute(path: str | None) -> str | None:
        if path is None or not Path(path).exists():
            return path
        return str(Path(path).resolve())

    # The snapshot folder need not exist yet; one named here (flag or environment) is the
    # same folder for every replica, else each uses its own host's cache dir.
    snapshots = engine.named_kv_snapshot_dir
    return dataclasses.replace(
        engine,
        model=absolute(engine.model),
        prefix_file=absolute(engine.prefix_file),
        chat_template=absolute(engine.chat_template),
        kv_snapshot_dir=str(Path(snapshots).expanduser().resolve()) if snapshots else None,
    )
