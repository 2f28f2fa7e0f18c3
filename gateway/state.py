"""Gateway: what every route shares (engine, tokenizer, auth, backpressure, metrics).

The engine loads in a worker thread after the server starts listening, so /health can say
503 while the model and the registry prefixes are prepared, then 200.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from starlette.requests import Request

from engine import AsyncEngine, EngineStats
from gateway import errors
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)


class Gateway:
    def __init__(self, config: GatewayConfig, engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.engine: AsyncEngine | None = engine
        self.load_error: str | None = None
        self.created = int(time.time())
        self.num_waiting = 0  # accepted by the gateway, no token out yet
        self.metrics = GatewayMetrics(self._stats, self.model_name)
        if engine is not None:
            engine.start()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the engine (model + registry prefill) off the event loop."""
        if self.engine is not None:
            return
        engine = AsyncEngine(self.config.engine)
        try:
            await asyncio.to_thread(engine.start)  # loads on the engine's own thread
        except Exception as exc:  # keep serving /health with the reason
            logger.exception("engine failed to start")
            self.load_error = str(exc)
            raise
        self.engine = engine
        self.metrics.model_name = self.model_name
        logger.info(
            "ready: serving %s at http://%s:%d/v1",
            self.model_name,
            self.config.host,
            self.config.port,
        )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None or not self.engine.is_running:
            raise errors.not_ready(self.load_error)
        return self.engine

    # -- facts about the model ----------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.model_name if self.engine is not None else "loading"

    @property
    def tokenizer(self) -> Any:
        return self.ready_engine().tokenizer

    @property
    def max_model_len(self) -> int:
        return self.ready_engine().max_model_len

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise errors.unknown_model(name)

    # -- auth and backpressure -------------------------------------------------------------------
    def check_auth(self, request: Request, admin: bool = False) -> None:
        """Bearer key for every protected route; registry admin needs the admin key when one
        is set (it then suffices on its own). Missing/wrong key: 401; a valid non-admin key on
        an admin route: 403."""
        token = _bearer(request)
        if admin and self.config.admin_api_key is not None:
            if _same(token, self.config.admin_api_key):
                return
            if self.config.api_key is not None and _same(token, self.config.api_key):
                raise errors.forbidden("this route needs the admin API key")
            raise errors.unauthorized()
        if self.config.api_key is not None and not _same(token, self.config.api_key):
            raise errors.unauthorized()

    def check_capacity(self) -> None:
        if self.num_waiting >= self.config.max_waiting:
            raise errors.too_many_requests(retry_after=1.0)

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return request.headers.get("x-api-key")


def _same(token: str | None, key: str) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), key.encode())
