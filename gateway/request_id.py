"""`x-request-id` on every response: the client's own when it sent a usable one (so its logs
and ours line up), else a fresh one. Pure ASGI, so streamed responses pass through as they
are (Starlette's BaseHTTPMiddleware would buffer them behind a task)."""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# Echoed only when it is short, printable ASCII: it goes into our headers and logs.
_USABLE = re.compile(r"^[\x21-\x7e]{1,128}$")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == HEADER.encode():
            text = bytes(value).decode("latin-1")
            if _USABLE.match(text):
                return text
            break
    return uuid.uuid4().hex
