"""uvicorn as prefixgate runs it.

`DrainingServer`: on SIGTERM the listener stays open while the gateway drains (new requests
get an OpenAI-shaped 503, requests in flight get `--shutdown-grace` seconds, then streams end
with an error event and `[DONE]`); only then does uvicorn close the listener and exit. A
second SIGTERM or SIGINT exits at once.

`GatewayH11Protocol`: request heads over `MAX_HEADER_BYTES` get an OpenAI-shaped 431 (uvicorn
answers a plain-text 400), and the connection lingers, reading and dropping what the client
still sends, so the client reads its 431 instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway import errors
from gateway.state import Gateway

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway, grace: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_draining = False
        self._drain: asyncio.Task[None] | None = None  # kept referenced while it runs

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._is_draining or not self.started:
            super().handle_exit(sig, frame)  # before start, or a second signal: exit now
            return
        self._is_draining = True
        logger.info("signal %d: draining before exit", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.gateway.drain(self.grace)
        finally:
            self.should_exit = True


MAX_HEADER_BYTES = 64 * 1024  # the request line and headers together
LINGER_SECONDS = 2.0


class GatewayH11Protocol(H11Protocol):
    _is_lingering = False

    def data_received(self, data: bytes) -> None:
        if not self._is_lingering:  # else: drop what the refused client still sends
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        pending, _ = self.conn.trailing_data
        if len(pending) <= MAX_HEADER_BYTES:
            super().send_400_response(msg)
            return
        error = errors.OpenAIError(
            431,
            f"The request's headers are larger than this server accepts ({MAX_HEADER_BYTES} "
            "bytes).",
            code="request_header_fields_too_large",
        )
        body = json.dumps(error.body()).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        self.transport.write(head + body)
        self._is_lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)


def uvicorn_config(
    app: object, host: str, port: int, grace: float, keep_alive: float
) -> uvicorn.Config:
    """The one uvicorn configuration the CLI serves with. Keep-alive outlasts the clients'
    pools: at uvicorn's default 5 s, equal to httpx's, a pooled connection reused as the
    server closed it failed a request ("Server disconnected without sending a response")."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        timeout_keep_alive=max(1, math.ceil(keep_alive)),
        log_config=None,
        http=GatewayH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=max(math.ceil(grace), 1),
        lifespan="on",
    )
