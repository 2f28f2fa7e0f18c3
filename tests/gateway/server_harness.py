"""Run `prefixgate serve` as a real uvicorn subprocess on 127.0.0.1 for end-to-end tests,
and compute what it must answer with an in-process engine on the same weights (`Reference`).

`start_server` picks a free port, starts `python -m prefixgate serve ...` in its own process
group with stdout/stderr going to a log file, and polls GET /health until it answers 200.
`Server.stop()` sends SIGTERM to the server's PID, waits (bounded), falls back to SIGKILL,
and returns the exit code. `ServerFactory` stops every server it started that is still
running; `running_server` does the same for one server as a context manager.

Every wait here is bounded; the deadlines only bound the tests, they are never asserted.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import (
    EngineConfig,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    chat_prompt_ids,
    text_prompt_ids,
)

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_READY_TIMEOUT = 60.0
# The real model prefills the shipped prefixes (~1,900 tokens) before /health says 200; on two
# shared CPU cores that has been seen to take 45 s.
REAL_READY_TIMEOUT = 180.0
STOP_TIMEOUT = 45.0  # above the default --shutdown-grace of 30 s
HTTP_TIMEOUT = 30.0

T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(
    probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1
) -> T:
    """Call `probe` until it returns something other than None/False; bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result is not None and result is not False:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Server:
    """One `prefixgate serve` process. `url` is the server root (the API is under /v1)."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None = None
    returncode: int | None = None
    was_killed: bool = False  # stop() had to SIGKILL it

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def log(self, tail: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail:]

    def headers(self, key: str | None = None) -> dict[str, str]:
        token = key if key is not None else self.api_key
        return {"Authorization": f"Bearer {token}"} if token else {}

    def client(self, key: str | None = None, timeout: float = HTTP_TIMEOUT) -> httpx.Client:
        """An httpx client on the server root; close it (use it as a context manager)."""
        return httpx.Client(base_url=self.url, headers=self.headers(key), timeout=timeout)

    def get_json(self, path: str, key: str | None = None) -> Any:
        with self.client(key) as client:
            response = client.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def post_json(self, path: str, body: dict[str, Any], key: str | None = None) -> Any:
        with self.client(key) as client:
            response = client.post(path, json=body)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def metrics(self) -> dict[str, float]:
        """Sample name -> value for every /metrics sample whose only label is model_name."""
        with self.client() as client:
            response = client.get("/metrics")
        assert response.status_code == 200, response.text
        values = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if set(sample.labels) <= {"model_name"}:
                    values[sample.name] = sample.value
        return values

    def wait_ready(self, timeout: float) -> None:
        def healthy() -> bool:
            if not self.is_running:
                raise RuntimeError(
                    f"server exited with {self.process.returncode} before it was ready:\n"
                    + self.log()
                )
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            return False

        wait_until(healthy, timeout, f"{self.url}/health to answer 200", interval=0.2)

    def send_signal(self, sig: int) -> None:
        if self.is_running:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait up to `timeout` s, then SIGKILL; returns the exit code."""
        if self.returncode is not None:
            return self.returncode
        self.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()  # SIGKILL, by PID
            self.was_killed = True
            self.returncode = self.process.wait(timeout=10.0)
        return self.returncode


def start_server(
    args: Sequence[str],
    log_dir: Path,
    ready_timeout: float = TINY_READY_TIMEOUT,
    api_key: str | None = None,
    name: str = "server",
) -> Server:
    """Start `prefixgate serve <args>` on a free port and wait until /health answers 200.

    `api_key`, if given, is passed as `--api-key` and used by the Server's helpers."""
    port = free_port()
    command = [sys.executable, "-m", "prefixgate", "serve", "--host", HOST, "--port", str(port)]
    command += list(args)
    if api_key is not None:
        command += ["--api-key", api_key]
    env = dict(os.environ)
    env.pop("PREFIXGATE_API_KEY", None)
    env.pop("PREFIXGATE_ADMIN_API_KEY", None)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log_path = log_dir / f"{name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,  # its own process group: a Ctrl-C in pytest does not hit it
        )
    server = Server(process, port, log_path, api_key)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop(timeout=10.0)
        raise
    return server


@dataclass
class ServerFactory:
    """Starts servers; `close()` stops every one still running (pytest fixture teardown)."""

    log_dir: Path
    servers: list[Server] = field(default_factory=list)

    def __call__(
        self,
        *args: str,
        ready_timeout: float = TINY_READY_TIMEOUT,
        api_key: str | None = None,
        name: str = "server",
    ) -> Server:
        server = start_server(args, self.log_dir, ready_timeout, api_key, name)
        self.servers.append(server)
        return server

    def close(self) -> dict[int, int]:
        """Stop what is still running; returns {pid: exit code} of the servers it stopped."""
        codes = {}
        for server in self.servers:
            if server.returncode is None:
                codes[server.pid] = server.stop()
        return codes


@contextlib.contextmanager
def running_server(
    args: Sequence[str],
    log_dir: Path,
    ready_timeout: float = TINY_READY_TIMEOUT,
    api_key: str | None = None,
) -> Iterator[Server]:
    server = start_server(args, log_dir, ready_timeout, api_key)
    try:
        yield server
    finally:
        server.stop()


class Reference:
    """Expected outputs: an LLMEngine in this process, on the weights the server serves.

    Greedy and seeded outputs are deterministic, so a server's text must equal these to the
    character (the engine tests already pin them to transformers), with or without the
    server's speculative decoding."""

    def __init__(self, model: Path, block_size: int, num_kv_blocks: int, max_model_len: int):
        config = EngineConfig(
            model=str(model),
            dtype="float32",
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            speculative="off",  # one token a step: `run` gives each token's own delta
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def run(self, prompt_ids: list[int], params: SamplingParams) -> list[RequestOutput]:
        """One request to its end; its outputs step by step."""
        request_id = f"ref-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_ids, params)
        outputs: list[RequestOutput] = []
        for _ in range(self.engine.max_model_len + 1):  # bounded: a token per step at least
            outputs += self.engine.step()
            if not self.engine.has_unfinished_requests():
                assert {o.request_id for o in outputs} == {request_id}
                return outputs
        raise AssertionError("the reference request did not finish")

    def text(self, prompt_ids: list[int], params: SamplingParams) -> str:
        return "".join(o.text for o in self.run(prompt_ids, params))

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        return self.text(self.chat_ids(messages), greedy(max_tokens))

    def completion(self, prompt: str | list[int], max_tokens: int) -> str:
        ids = prompt if isinstance(prompt, list) else self.text_ids(prompt)
        return self.text(ids, greedy(max_tokens))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def text_ids(self, text: str) -> list[int]:
        return text_prompt_ids(self.tokenizer, text)


def greedy(max_tokens: int, **overrides: Any) -> SamplingParams:
    """Greedy with `ignore_eos`: always exactly `max_tokens` tokens (unless a stop hits)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **overrides)
