"""The spare worker keeper against a fake raylet that answers with Ray's own protobuf messages,
and the preload module in fresh interpreters. tests/replicas/test_ray_serve.py shows a real
replacement starting on the spare."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
from ray._private.utils import get_runtime_env_info
from ray.core.generated import common_pb2, node_manager_pb2
from ray.runtime_env import RuntimeEnv

from replicas.spare_worker import (
    PRELOAD_ENV_VAR,
    SpareWorkerConfig,
    SpareWorkerKeeper,
    started_for_our_actors,
)

NIL = b"\xff" * 16
JOB = bytes.fromhex("01000000")


# pids the fake node's workers carry: ours were started with our actors' runtime env, Ray's
# own prestarts (one a CPU, the job's default env) were not
OURS, RAYS = 100, 200


def worker(
    kind: int = common_pb2.WORKER,
    actor: bytes = NIL,
    tasks: int = 0,
    running: int = 0,
    pid: int = OURS,
) -> Any:
    return common_pb2.CoreWorkerStats(
        worker_type=kind,
        actor_id=actor,
        num_executed_tasks=tasks,
        num_running_tasks=running,
        pid=pid,
    )


DRIVER = worker(kind=common_pb2.DRIVER)
REPLICA = worker(actor=bytes(range(16)), tasks=40, running=1)


class FakeRaylet:
    """Answers GetNodeStats with the workers it holds; PrestartWorkers records the request
    and, after `registers_after` more polls, adds that many unused workers."""

    def __init__(self, workers: list[Any], unlisted: int = 0, registers_after: int = 0) -> None:
        self.workers = list(workers)
        self.unlisted = unlisted
        self.registers_after = registers_after
        self.prestarts: list[Any] = []
        self.polls = 0
        self._coming: list[tuple[int, int]] = []  # (poll it registers on, count)
        self.on_poll: list[Any] = []

    def GetNodeStats(self, request: Any, timeout: float) -> Any:
        assert request.include_memory_info is False
        self.polls += 1
        for hook in self.on_poll:
            hook(self)
        for due, count in [c for c in self._coming if c[0] <= self.polls]:
            self.workers += [worker() for _ in range(count)]
            self._coming.remove((due, count))
        return node_manager_pb2.GetNodeStatsReply(
            core_workers_stats=self.workers, num_workers=len(self.workers) + self.unlisted
        )

    def PrestartWorkers(self, request: Any, timeout: float) -> Any:
        self.prestarts.append(request)
        self._coming.append((self.polls + self.registers_after, request.num_workers))
        return node_manager_pb2.PrestartWorkersReply()


def keeper(raylet: FakeRaylet, **config: Any) -> SpareWorkerKeeper:
    runtime_env = get_runtime_env_info(RuntimeEnv(env_vars={"A": "1"}))
    return SpareWorkerKeeper(
        raylet, JOB, runtime_env, SpareWorkerConfig(**config), ours=lambda pid: pid == OURS
    )


class Polls:
    """A stop event that lets the keeper's loop run `n` times without waiting."""

    def __init__(self, n: int) -> None:
        self.left = n

    def wait(self, timeout: float) -> bool:
        self.left -= 1
        return self.left < 0


def run(k: SpareWorkerKeeper, polls: int) -> None:
    k.run(Polls(polls))  # type: ignore[arg-type]


def test_only_workers_that_never_ran_anything_count_as_spare() -> None:
    used_task_worker = worker(tasks=3)
    running = worker(running=1)
    io_worker = worker(kind=common_pb2.SPILL_WORKER)
    raylet = FakeRaylet([DRIVER, REPLICA, used_task_worker, running, io_worker])
    assert keeper(raylet).idle_workers() == 0
    raylet.workers += [worker(), worker(actor=b"")]
    assert keeper(raylet).idle_workers() == 2


def test_rays_own_idle_prestarts_are_not_spares_so_one_of_ours_is_started() -> None:
    # a 16-core node: Ray prestarted 16 workers with the job's default runtime env; the
    # controller and the proxy took 2, the other 14 idle ones cannot take our actors
    rays = [worker(pid=RAYS) for _ in range(14)]
    raylet = FakeRaylet([DRIVER, REPLICA, *rays], registers_after=1)
    k = keeper(raylet)
    assert k.idle_workers() == 0
    run(k, 4)
    assert [r.num_workers for r in raylet.prestarts] == [1]
    assert k.idle_workers() == 1


def test_a_worker_started_with_our_runtime_env_is_told_by_its_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV_VAR}
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep, env={**env, PRELOAD_ENV_VAR: "1"})
    rays = subprocess.Popen(sleep, env={**env, f"NOT_{PRELOAD_ENV_VAR}": "1"})
    try:
        assert started_for_our_actors(ours.pid)
        assert not started_for_our_actors(rays.pid)
    finally:
        for process in (ours, rays):
            process.kill()
            process.wait()
    # gone (or never there): counted as ours, so that no spare is started too many
    assert started_for_our_actors(ours.pid)


def test_a_worker_without_stats_counts_as_spare_so_none_is_started_too_many() -> None:
    raylet = FakeRaylet([DRIVER, REPLICA], unlisted=1)
    k = keeper(raylet)
    assert k.idle_workers() == 1
    run(k, 5)
    assert raylet.prestarts == []


def test_a_missing_spare_is_started_for_this_job_with_our_runtime_env() -> None:
    raylet = FakeRaylet([DRIVER, REPLICA], registers_after=1)
    k = keeper(raylet, keep_alive=1234)
    run(k, 4)
    [request] = raylet.prestarts
    assert request.language == common_pb2.PYTHON
    assert request.job_id == JOB
    assert request.num_workers == 1
    assert request.keep_alive_duration_secs == 1234
    assert request.runtime_env_info.serialized_runtime_env == '{"env_vars": {"A": "1"}}'
    assert k.idle_workers() == 1 and k.started == 1


def test_a_spare_taken_by_a_replacement_is_replaced() -> None:
    raylet = FakeRaylet([DRIVER, REPLICA, worker()])

    def take_the_spare(r: FakeRaylet) -> None:
        if r.polls == 3:  # a replica died; its replacement starts on the spare
            r.workers[2] = worker(actor=bytes(range(1, 17)), tasks=1)

    raylet.on_poll.append(take_the_spare)
    run(keeper(raylet), 6)
    assert len(raylet.prestarts) == 1


def test_a_slow_spare_is_not_asked_for_twice_until_its_start_times_out() -> None:
    raylet = FakeRaylet([DRIVER, REPLICA], registers_after=10**6)  # never registers
    run(keeper(raylet, interval=0.0, start_timeout=3600.0), 20)
    assert len(raylet.prestarts) == 1
    run(keeper(raylet, interval=0.0, start_timeout=0.0), 3)
    assert len(raylet.prestarts) == 4


def test_more_spares_are_asked_for_at_once() -> None:
    raylet = FakeRaylet([DRIVER, REPLICA, worker()], registers_after=1)
    run(keeper(raylet, spares=3), 3)
    assert [r.num_workers for r in raylet.prestarts] == [2]


def test_a_failing_raylet_ends_the_keeper_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeRaylet):
        def GetNodeStats(self, request: Any, timeout: float) -> Any:
            raise RuntimeError("raylet gone")

    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="replicas.spare_worker"):
        keeper(Broken([]), interval=0.0).run(stop)  # returns instead of looping
    assert "spare worker keeper stopped (raylet gone)" in caplog.text
    assert not stop.is_set()


CHECK = "import sys, replicas.preload; print('torch' in sys.modules, 'replicas.app' in sys.modules)"


@pytest.mark.parametrize(("value", "imports"), [("1", "True True"), (None, "False False")])
def test_the_preload_imports_the_package_only_into_our_actors_workers(
    value: str | None, imports: str
) -> None:
    """Ray imports replicas.preload into every worker of a cluster we start: the controller's
    and the proxy's must stay without torch (~140 MB each)."""
    env = {k: v for k, v in os.environ.items() if k != PRELOAD_ENV_VAR}
    if value is not None:
        env[PRELOAD_ENV_VAR] = value
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.split() == imports.split()
