"""Gateway: what every route shares (engine, tokenizer, auth, backpressure, metrics).

The engine loads in a worker thread after the server starts listening, so /health can say
503 while the model and the registry prefixes are prepared, then 200.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from starlette.requests import Request

from engine import (
    AsyncEngine,
    EngineError,
    EngineStats,
    ReasoningFormat,
    ToolFormat,
    reasoning_format_of,
    tool_format_of,
)
from gateway import errors
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient, ReplicaHealth, ReplicaSetView
from gateway.logprobs import token_pieces
from gateway.metrics import GatewayMetrics
from gateway.response_db import open_response_store
from gateway.response_store import ResponseStore
from gateway.tenants import Caller, KeyRing
from gateway.waiting import Ticket, WaitingQueue

logger = logging.getLogger(__name__)
T = TypeVar("T")
Access = Literal["inference", "read", "admin"]


class Gateway:
    """`engine`: a ready engine (tests); else `connect()` makes one when the app starts (the
    configured model in this process by default; Ray Serve's ingress passes its replicas)."""

    def __init__(
        self,
        config: GatewayConfig,
        engine: EngineClient | None = None,
        connect: Callable[[], EngineClient] | None = None,
    ) -> None:
        self.config = config
        self.engine: EngineClient | None = engine
        self.keys = KeyRing(config.api_keys, config.api_key_file)
        served = self.keys.serving(config.engine)
        self._connect = connect or (lambda: AsyncEngine(served))
        self.load_error: str | None = None
        self.created = int(time.time())
        self.waiting = WaitingQueue(config.max_waiting)
        self.cpu_kernels: str | None = None  # the engine's kernel target, once it started
        self.is_draining = False  # SIGTERM: refuse new requests, finish or end the rest
        self._logprob_texts: asyncio.Future[Any] | None = None  # see _facts_of
        self._tool_format: ToolFormat | None = None
        self.metrics = GatewayMetrics(self.stats_by_replica, self.model_name)
        self.responses: ResponseStore = open_response_store(config)
        # Parsing, rendering and tokenizing run here, never on the event loop: a 5 MB prompt
        # takes seconds to tokenize, and every open stream would wait behind it.
        self._workers = ThreadPoolExecutor(
            config.tokenizer_workers, thread_name_prefix="prefixgate-tokenize"
        )
        if isinstance(engine, AsyncEngine):  # tests hand over a built, unstarted one
            engine.start()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the engine (model + registry prefill) off the event loop, and decode the
        logprob texts of its vocabulary there too (not per streamed token on the loop)."""
        if self.engine is not None:
            await self._facts_of(self.engine)
            return
        engine = self._connect()
        try:
            await engine.open()
        except Exception as exc:  # keep serving /health with the reason
            if isinstance(exc, EngineError):  # the operator's to mend (a file, a model): said
                logger.error("engine failed to start: %s", exc)  # plainly, in one line
            else:
                logger.exception("engine failed to start")
            self.load_error = str(exc)
            raise
        await self._facts_of(engine)
        self.engine = engine
        self.metrics.model_name = self.model_name
        logger.info(
            "ready: serving %s at http://%s:%d/v1",
            self.model_name,
            self.config.host,
            self.config.port,
        )

    @property
    def num_waiting(self) -> int:
        """Sequences admitted by the gateway that have no output yet."""
        return self.waiting.num_waiting

    @property
    def tickets(self) -> set[Ticket]:
        """Requests in flight, from admission to the end of their response."""
        return self.waiting.tickets

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def drain(self, grace: float) -> None:
        """SIGTERM: refuse new requests (503, /health too), give the requests in flight `grace`
        seconds, then end the rest by stopping the engine: streams get an error event and
        `[DONE]`, non-streaming requests a 503. Returns when every response has ended (or a
        few seconds after the engine stopped, whichever is first); the caller then closes
        the listener."""
        self.is_draining = True
        loop = asyncio.get_running_loop()
        logger.info("draining: %d requests in flight, %.1f s grace", len(self.tickets), grace)
        await _until(lambda: not self.tickets, loop.time() + grace)
        if self.tickets and self.engine is not None:
            logger.warning("grace over: ending %d requests still in flight", len(self.tickets))
            await asyncio.to_thread(self.engine.shutdown)
            await _until(lambda: not self.tickets, loop.time() + _DRAIN_FLUSH_SECONDS)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound request work (parse, render, tokenize) in the worker pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, functools.partial(fn, *args))

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def replica_health(self) -> ReplicaHealth:
        """A ready engine's replicas: whether they serve one registry, and what is short;
        always healthy for a single engine."""
        replicas = self.replicas
        return replicas.health() if replicas is not None else ReplicaHealth()

    @property
    def replicas(self) -> ReplicaSetView | None:
        """The engine's replicas when it has several (Ray Serve), else None."""
        return self.engine if isinstance(self.engine, ReplicaSetView) else None

    def ready_engine(self) -> EngineClient:
        if self.engine is None or not self.engine.is_running:
            raise errors.not_ready(self.load_error)
        return self.engine

    # -- facts about the model ----------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.model_name if self.engine is not None else "loading"

    async def _facts_of(self, engine: EngineClient) -> None:
        """What a started engine will not change, read once: the C++ kernels' target for
        /health, and the logprob texts of its vocabulary. Those are decoded in the worker
        pool, never per streamed token on the loop, and not before /health turns 200 either:
        ~0.4 s for a 49k vocabulary is a tenth of a warm start. Requests that want logprobs
        wait for the table (`logprob_texts_ready`)."""
        self.cpu_kernels = engine.stats().cpu_kernels
        self._logprob_texts = asyncio.ensure_future(
            self.run_blocking(token_pieces, engine.tokenizer)
        )

    async def logprob_texts_ready(self) -> None:
        """Return once the vocabulary's logprob texts are decoded (at once after the first
        half second of a start)."""
        if self._logprob_texts is not None:
            await asyncio.shield(self._logprob_texts)

    @property
    def tokenizer(self) -> Any:
        return self.ready_engine().tokenizer

    @property
    def tool_format(self) -> ToolFormat:
        """How the served model writes tool calls, from its chat template and tokenizer
        (read once: both are fixed once the engine is ready)."""
        if self._tool_format is None:
            tokenizer = self.tokenizer
            self._tool_format = tool_format_of(tokenizer.chat_template, tokenizer.get_added_vocab())
        return self._tool_format

    @functools.cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How the served model marks its thinking (engine/text/reasoning.py), None for a
        model that does not think; read once (a start that is not ready yet raises, and is
        read again)."""
        tokenizer = self.tokenizer
        return reasoning_format_of(tokenizer.chat_template, tokenizer.get_added_vocab())

    @property
    def max_model_len(self) -> int:
        return self.ready_engine().max_model_len

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise errors.unknown_model(name)

    # -- auth and backpressure -------------------------------------------------------------------
    def check_auth(self, request: Request, access: Access = "inference") -> Caller:
        """Who is calling, if they may. "inference" routes: an API key (a tenant) or the
        admin key; open when no API key is configured. "read" routes (the registry listing
        and /match): a tenant sees the entries it may hit, the admin key everything.
        "admin" routes (reload): the admin key only; with API keys but no admin key they are
        closed (403), so a key clients hold can never reload the registry. With no keys at
        all, everything is open (local development). Missing or wrong key: 401; a valid key
        without the right: 403."""
        token = _bearer(request)
        admin_key = self.config.admin_api_key
        if admin_key is not None and _same(token, admin_key):
            return Caller(is_admin=True)
        if admin_key is None and self.keys.is_empty:
            return Caller(is_admin=True)
        tenant = self.keys.tenant_of(token)
        if access == "admin" or (access == "read" and self.keys.is_empty):
            if tenant is not None:
                raise errors.forbidden(
                    "this route needs the admin API key"
                    if admin_key is not None
                    else "registry admin routes need an admin API key: start the server "
                    "with --admin-api-key to use them"
                )
            raise errors.unauthorized()
        if tenant is None and not self.keys.is_empty:
            raise errors.unauthorized()
        return Caller(tenant)

    def check_metrics_auth(self, request: Request) -> None:
        """/metrics is public unless --metrics-api-key is set; then it or the admin key."""
        metrics_key = self.config.metrics_api_key
        if metrics_key is None:
            return
        token = _bearer(request)
        admin_key = self.config.admin_api_key
        if _same(token, metrics_key) or (admin_key is not None and _same(token, admin_key)):
            return
        raise errors.unauthorized()

    def open_ticket(self) -> Ticket:
        """A place in the waiting queue for one more request, or 503 (draining) / 429."""
        if self.is_draining:
            raise errors.shutting_down()
        return self.waiting.open()

    def stats_by_replica(self) -> dict[str | None, EngineStats]:
        """Engine stats for /metrics: by replica name, or {None: stats} for one engine;
        empty before the engine is ready."""
        if self.engine is None or not self.engine.is_running:
            return {}
        replicas = self.replicas
        if replicas is None:
            return {None: self.engine.stats()}
        return {r.name: r.stats for r in replicas.replica_states() if r.stats is not None}


_DRAIN_FLUSH_SECONDS = 5.0  # for ended responses to reach their clients


async def _until(done: Callable[[], bool], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return request.headers.get("x-api-key")


def _same(token: str | None, key: str) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), key.encode())
