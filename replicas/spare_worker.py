"""A started worker process kept spare on this node, so a replica that dies is replaced fast.

When a replica's process dies, Serve's controller asks Ray for a new actor. Ray reuses an
idle worker process only if it never ran anything; otherwise it starts a Python process
(~1.5 s here) which then imports torch, the engine and the gateway (~2 s) before the engine
can even load. Ray prestarts such workers when a driver starts, but those are taken by the
controller, the proxy and the first replicas, and Ray does not replace them.

`SpareWorkerKeeper` keeps one: every `interval` seconds it asks the node's raylet how many
worker processes that could take our actors never ran anything and, when none, asks it to
start one for this job
(`PrestartWorkers`, the RPC Ray's own prestarts use) with our actors' runtime env
(`ACTOR_RUNTIME_ENV`): Ray gives an actor only a worker started with the runtime env the actor
asks for, and that env makes `replicas.preload` import this package as the worker starts. The
replacement's actor then starts on the spare and goes straight to loading the engine.

Which idle workers could take our actors is read from each one's environment: Ray's own
prestarts (`enable_worker_prestart`: one a CPU, with the job's default runtime env) cannot.
On 2 CPUs the controller and the proxy take those. On a 16-core host most of them stay idle;
counted as spares, they kept the keeper from starting any, and every replacement there
started cold (its first log line 6-11 s after the kill, against ~0.5 s on a spare).

The RPCs are Ray's internal node-manager service (as `ray._private.internal_api` calls it);
anything that fails here is logged once and ends the keeper, never the server.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The modules Ray imports into every worker a cluster we start starts (see replicas.preload),
# and the runtime env of our actors: it makes the preload import the package, and Ray gives
# an actor only a worker started with the same runtime env, so the spare carries it too.
PRELOAD_MODULES = ["replicas.preload"]
PRELOAD_ENV_VAR = "PREFIXGATE_PRELOAD"
PRELOAD_ENV_VALUE = "1"
ACTOR_RUNTIME_ENV: dict[str, Any] = {"env_vars": {PRELOAD_ENV_VAR: PRELOAD_ENV_VALUE}}


def started_for_our_actors(pid: int) -> bool:
    """Whether worker process `pid` was started with ACTOR_RUNTIME_ENV: Ray puts a runtime
    env's env_vars in the environment a worker starts with, which /proc keeps (the keeper runs
    on the node it counts). One whose environment cannot be read counts as ours, so that it
    can only leave a spare missing, never start one too many."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return True
    return f"{PRELOAD_ENV_VAR}={PRELOAD_ENV_VALUE}".encode() in environ.split(b"\0")


@dataclass(frozen=True)
class SpareWorkerConfig:
    """How many spares, how often to look, how long a requested spare may take to register
    before it is asked for again, and how long an unused spare lives (Ray's keep-alive)."""

    spares: int = 1
    interval: float = 0.5
    start_timeout: float = 30.0
    keep_alive: int = 24 * 3600


class SpareWorkerKeeper:
    """Keeps `config.spares` idle worker processes of one job started on one node. `stub` is
    the node's raylet (`NodeManagerServiceStub`); `for_this_node` builds it from Ray."""

    def __init__(
        self,
        stub: Any,
        job_id: bytes,
        runtime_env: Any,
        config: SpareWorkerConfig,
        ours: Callable[[int], bool] = started_for_our_actors,
    ) -> None:
        self._stub = stub
        self._ours = ours  # whether a worker's pid could take our actors
        self._job_id = job_id
        self._runtime_env = runtime_env
        self.config = config
        # Ray ships no type stubs for its generated protobuf modules.
        self._common: Any = importlib.import_module("ray.core.generated.common_pb2")
        self._messages: Any = importlib.import_module("ray.core.generated.node_manager_pb2")
        self.started = 0  # spares asked for, for logs and tests

    @classmethod
    def for_this_node(cls, config: SpareWorkerConfig | None = None) -> SpareWorkerKeeper:
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray._private.utils import get_runtime_env_info
        from ray.runtime_env import RuntimeEnv

        grpc_module: Any = importlib.import_module("ray.core.generated.node_manager_pb2_grpc")
        context = ray.get_runtime_context()
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        node = next(n for n in nodes if n["NodeID"] == context.get_node_id())
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        return cls(
            grpc_module.NodeManagerServiceStub(channel),
            bytes.fromhex(context.get_job_id()),
            get_runtime_env_info(RuntimeEnv(**ACTOR_RUNTIME_ENV)),
            config or SpareWorkerConfig(),
        )

    def idle_workers(self) -> int:
        """Worker processes on this node that never ran anything and could take our actors:
        the raylet reports them with no actor and no task executed, and each was started with
        our actors' runtime env (`ours`). A worker whose stats did not come back (the
        raylet counts it in `num_workers` but lists no stats) is taken for idle too, so an
        unanswered poll can only leave a spare missing, never start one too many."""
        reply = self._stub.GetNodeStats(
            self._messages.GetNodeStatsRequest(include_memory_info=False), timeout=10
        )
        stats = list(reply.core_workers_stats)
        unused = [
            worker
            for worker in stats
            if worker.worker_type == self._common.WORKER
            and worker.num_executed_tasks == 0
            and worker.num_running_tasks == 0
            and worker.actor_id.strip(b"\xff") == b""  # Ray's nil id is all 0xff
            and self._ours(worker.pid)
        ]
        return len(unused) + max(0, int(reply.num_workers) - len(stats))

    def start_spares(self, count: int) -> None:
        self._stub.PrestartWorkers(
            self._messages.PrestartWorkersRequest(
                language=self._common.PYTHON,
                job_id=self._job_id,
                runtime_env_info=self._runtime_env,
                num_workers=count,
                keep_alive_duration_secs=self.config.keep_alive,
            ),
            timeout=10,
        )
        self.started += count

    def run(self, stop: threading.Event) -> None:
        """Loop until `stop` is set. A spare asked for counts as coming until it registers or
        `start_timeout` passes, so a slow start is not asked for twice."""
        asked_at: float | None = None
        try:
            while not stop.wait(self.config.interval):
                idle = self.idle_workers()
                if idle >= self.config.spares:
                    asked_at = None
                    continue
                if asked_at is not None and time.monotonic() - asked_at < self.config.start_timeout:
                    continue
                self.start_spares(self.config.spares - idle)
                asked_at = time.monotonic()
                logger.info(
                    "spare worker: %d started for the next replica replacement",
                    self.config.spares - idle,
                )
        except Exception as error:  # Ray's internals may change; serving goes on
            logger.warning("spare worker keeper stopped (%s): replacements start cold", error)


def keep_spare_workers(stop: threading.Event) -> threading.Thread | None:
    """Start a daemon thread that keeps a spare worker until `stop`; None if the keeper cannot
    reach the raylet (a warning says so)."""
    try:
        keeper = SpareWorkerKeeper.for_this_node()
    except Exception as error:
        logger.warning("no spare worker (%s): replacements start cold", error)
        return None
    thread = threading.Thread(target=keeper.run, args=(stop,), name="spare-worker", daemon=True)
    thread.start()
    return thread
