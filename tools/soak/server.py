"""The server under test: a `prefixgate serve` the soak starts and stops by its PID, and what
any server reports (GET /v1/models, /metrics, GET /v1/prefixes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tools.soak.config import REPO, ServerSettings, SoakError, Target
from tools.soak.results import KvState

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    """A `prefixgate serve` the soak started; only ever stopped by its own PID."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    command: list[str]
    returncode: int | None = None
    was_killed: bool = False

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise self._not_ready(f"the server exited with {self.process.returncode}")
            if self._is_healthy():
                return
            if time.monotonic() >= deadline:
                raise self._not_ready(f"the server was not ready after {timeout_s:g} s")
            time.sleep(0.25)

    def _not_ready(self, why: str) -> SoakError:
        return SoakError(f"{why}:\n{self.log_text()[-4000:]}")

    def _is_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; the exit code."""
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()  # SIGKILL, by PID
            self.was_killed = True
            self.returncode = self.process.wait(timeout=10.0)
        return self.returncode


def start_server(
    settings: ServerSettings, prefixes_file: Path, api_key: str, admin_api_key: str, work_dir: Path
) -> ServerProcess:
    """`python -m prefixgate serve` on 127.0.0.1 and a free port, in its own session, keys
    passed in the environment (not on a command line others can read); waits for /health."""
    port = free_port()
    command = server_command(settings, prefixes_file, port)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PREFIXGATE_METRICS_API_KEY", None)  # the soak reads /metrics without a key
    env.update(PREFIXGATE_API_KEY=api_key, PREFIXGATE_ADMIN_API_KEY=admin_api_key)
    log_path = work_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    server = ServerProcess(process, port, log_path, command)
    try:
        server.wait_ready(settings.ready_timeout_s)
    except BaseException:
        server.stop(timeout_s=10.0)
        raise
    return server


def server_command(settings: ServerSettings, prefixes_file: Path, port: int) -> list[str]:
    command = [sys.executable, "-m", "prefixgate", "serve", "--host", HOST, "--port", str(port)]
    if settings.model is not None:
        command += ["--model", settings.model]
    return [
        *command,
        *("--prefixes", str(prefixes_file)),
        *("--block-size", str(settings.block_size)),
        *("--num-kv-blocks", str(settings.num_kv_blocks)),
        *("--max-model-len", str(settings.max_model_len)),
        *("--max-num-seqs", str(settings.max_num_seqs)),
        *settings.extra_args,
    ]


def connect(
    url: str, api_key: str | None, admin_api_key: str | None, prefixes_file: Path | None
) -> Target:
    """The served model and its max_model_len, from GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
    if response.status_code != 200:
        raise SoakError(f"GET /v1/models answered {response.status_code}: {response.text[:300]}")
    card = response.json()["data"][0]
    return Target(
        url, str(card["id"]), int(card["max_model_len"]), api_key, admin_api_key, prefixes_file
    )


@dataclass(frozen=True)
class Scrape:
    values: dict[str, float]  # samples whose only label is model_name
    by_status: dict[str, float]  # prefixgate_requests_total summed over routes

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    @property
    def server_5xx(self) -> float:
        return sum(v for status, v in self.by_status.items() if status.startswith("5"))

    def kv(self) -> KvState:
        g = self.get
        return KvState(
            total=int(g("prefixgate_kv_blocks_total")),
            free=int(g("prefixgate_kv_blocks_free")),
            pinned=int(g("prefixgate_kv_blocks_pinned")),
            running=int(g("prefixgate_num_requests_running")),
            waiting=int(g("prefixgate_num_requests_waiting")),
        )


async def scrape(client: httpx.AsyncClient) -> Scrape:
    response = await client.get("/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    by_status: Counter[str] = Counter()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "prefixgate_requests_total":
                by_status[sample.labels["status"]] += int(sample.value)
            elif set(sample.labels) <= {"model_name"}:
                values[sample.name] = sample.value
    return Scrape(values, dict(by_status))


@dataclass(frozen=True)
class Listing:
    """GET /v1/prefixes, the parts the checks read."""

    names: list[str]
    hits: dict[str, int]
    reload_time: float | None
    reload_ok: bool | None
    reload_error: str | None
    pending: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Listing:
        last, data = body["last_reload"], body["data"]
        return cls(
            [p["name"] for p in data],
            {p["name"]: p["hits"] for p in data},
            last["time"],
            last["ok"],
            last["error"],
            last["pending"],
        )

    def reloaded_since(self, when: float) -> bool:
        return self.reload_time is not None and self.reload_time >= when and not self.pending
