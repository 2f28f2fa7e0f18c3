"""create_app(): the Starlette application, its routes and its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import errors
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.request_id import RequestIdMiddleware
from gateway.routes.chat import create_chat_completion
from gateway.routes.completions import create_completion
from gateway.routes.models import health, list_models, metrics, retrieve_model
from gateway.routes.openapi import get_openapi
from gateway.routes.prefixes import list_prefixes, match_prefix, reload_prefixes
from gateway.routes.responses import create_response, stored_response
from gateway.routes.tokens import detokenize, tokenize
from gateway.state import Gateway

logger = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    config: GatewayConfig,
    engine: EngineClient | None = None,
    on_fatal: Callable[[], None] | None = None,
    connect: Callable[[], EngineClient] | None = None,
) -> Starlette:
    """`engine=None` loads the configured model in the background once the server listens,
    so /health answers 503 meanwhile; if loading fails, `on_fatal` is called (the CLI stops
    the server and exits non-zero). Tests may pass a ready AsyncEngine instead; Ray Serve's
    ingress passes `connect`, which makes its engine (the replica set) at start."""
    gateway = Gateway(config, engine, connect)

    async def load() -> None:
        try:
            await gateway.start()
        except Exception:
            if on_fatal is not None:
                on_fatal()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # A model to load: listen at once (/health says 503 until it is up). A ready engine
        # (tests): read its facts first, so no request arrives before its token table.
        loading: asyncio.Task[None] | None = None
        if gateway.engine is None:
            loading = asyncio.create_task(load())
        else:
            await load()
        try:
            yield
        finally:
            if loading is not None:
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
            gateway.shutdown()
            await gateway.responses.close()

    def counted(route: str, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as exc:
                gateway.metrics.observe_request(route, errors.status_of(exc))
                raise
            gateway.metrics.observe_request(route, response.status_code)
            return response

        return wrapped

    routes = [
        Route(
            "/v1/chat/completions",
            counted("/v1/chat/completions", create_chat_completion),
            methods=["POST"],
        ),
        Route("/v1/completions", counted("/v1/completions", create_completion), methods=["POST"]),
        Route("/v1/responses", counted("/v1/responses", create_response), methods=["POST"]),
        Route(
            "/v1/responses/{id}",
            counted("/v1/responses/{id}", stored_response),
            methods=["GET", "DELETE"],
        ),
        Route("/v1/models", counted("/v1/models", list_models), methods=["GET"]),
        Route(
            "/v1/models/{model:path}",
            counted("/v1/models/{model}", retrieve_model),
            methods=["GET"],
        ),
        Route("/v1/prefixes", counted("/v1/prefixes", list_prefixes), methods=["GET"]),
        Route(
            "/v1/prefixes/reload", counted("/v1/prefixes/reload", reload_prefixes), methods=["POST"]
        ),
        Route("/v1/prefixes/match", counted("/v1/prefixes/match", match_prefix), methods=["POST"]),
        Route("/tokenize", counted("/tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", counted("/detokenize", detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", get_openapi, methods=["GET"]),
    ]
    middleware = [Middleware(RequestIdMiddleware)]
    if config.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
                expose_headers=["Retry-After"],
            )
        )
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.gateway = gateway
    errors.install_error_handlers(app)
    return app
