"""Admission: the one path a request body takes before a route acts on it.

In this order, so that nothing expensive happens for a request the server will refuse:
1. the API key (401/403);
2. a place in the waiting queue (`gateway.waiting.Ticket`): counted against `--max-waiting`
   before the body is even read, streaming or not (429), and refused while the server drains
   (503);
3. the body, read under `--max-request-bytes` (413) and `--request-read-timeout` (408), only
   as JSON (415 for other content types);
4. parsing, text validity (no lone surrogates) and the pydantic models, once, in the
   gateway's worker pool so a 5 MB body never stalls the event loop (400);
5. the ticket grows to the request's real size: n choices x prompts sequences.
Routes then render and tokenize in the same worker pool (`Gateway.run_blocking`) and prepare
their engine requests there (the engine validates each distinct prompt once).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request

from gateway import errors
from gateway.engine_client import EngineClient
from gateway.protocol import GenerationBase, json_type_name
from gateway.state import Gateway
from gateway.tenants import Caller
from gateway.waiting import Ticket

Body = TypeVar("Body", bound=BaseModel)
Generation = TypeVar("Generation", bound=GenerationBase)

# Media types accepted as JSON; a request without a Content-Type is read as JSON too (curl -d
# users forget it, and OpenAI's own API is lenient there).
_JSON_MEDIA_TYPE = re.compile(r"^application/([\w.+-]+\+)?json$")
# A lone surrogate can only come from a \uD800-\uDFFF escape; bodies without one skip the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# After refusing an oversized body, read (and drop) up to this many times the limit, so the
# client gets its 413 instead of a connection reset while it is still sending.
_DISCARD_FACTOR = 8


@dataclass(frozen=True, slots=True)
class Admitted(Generic[Generation]):
    """An admitted generation request: validated body, its open ticket, who sent it, and the
    ready engine it goes to (asked for once, before the body was read)."""

    body: Generation
    ticket: Ticket
    caller: Caller
    engine: EngineClient


async def admit(request: Request, body_type: type[Generation]) -> Admitted[Generation]:
    """Steps 1-5 of the module docstring for a generation route. The caller owns the ticket:
    it must `close()` it when the response ends (or when it fails before responding)."""
    gateway = gateway_of(request)
    caller = gateway.check_auth(request)
    ticket = gateway.open_ticket()
    try:
        engine = gateway.ready_engine()
        body = await read_model(request, body_type, {"tool_format": gateway.tool_format})
        gateway.check_model(body.model)
        _check_num_prompts(body.num_prompts, gateway.config.max_prompts)
        ticket.hold(body.num_sequences)
    except BaseException:
        ticket.close()
        raise
    return Admitted(body, ticket, caller, engine)


def _check_num_prompts(num_prompts: int, max_prompts: int) -> None:
    if num_prompts > max_prompts:
        raise errors.OpenAIError(
            400,
            f"Invalid value for 'prompt': {num_prompts} prompts in one request; this server "
            f"takes at most {max_prompts} (--max-prompts).",
            param="prompt",
            code="invalid_value",
        )


async def read_model(
    request: Request, body_type: type[Body], context: dict[str, Any] | None = None
) -> Body:
    """Read the body (limits, content type) and validate it off the event loop (`context`:
    pydantic's validation context)."""
    gateway = gateway_of(request)
    raw = await read_body(request, gateway.config.max_request_bytes)
    return await gateway.run_blocking(parse_model, raw, body_type, context)


def parse_model(raw: bytes, body_type: type[Body], context: dict[str, Any] | None = None) -> Body:
    """JSON object -> valid text -> the pydantic model; every failure an OpenAIError (400)."""
    return errors.validate(body_type, parse_json(raw), context)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. It must be UTF-8 (RFC 8259 8.1; a leading BOM is ignored):
    `json.loads` on bytes would also take UTF-16/32 and let UTF-8-encoded surrogates through
    (surrogatepass), which then break the tokenizer and error messages."""
    try:
        text = raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.invalid_json(f"the body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise errors.invalid_json(str(exc)) from None
    except RecursionError:
        raise errors.invalid_json("the JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise errors.invalid_json(f"expected a JSON object, but got {json_type_name(body)}")
    if _SURROGATE_ESCAPE.search(raw):
        check_text(body)
    return body


def check_text(body: Any) -> None:
    """Refuse strings that are not valid Unicode text (lone UTF-16 surrogates, which JSON
    escapes can spell but UTF-8 cannot encode): 400 naming the first offending field."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), body)]
    while stack:  # iterative: bodies nest as deep as the JSON parser allowed
        loc, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                raise _invalid_text(loc)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    raise _invalid_text(loc)
                stack.append(((*loc, key), item))
        elif isinstance(value, list):
            stack.extend(((*loc, i), item) for i, item in enumerate(value))


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_text(loc: tuple[int | str, ...]) -> errors.OpenAIError:
    param = errors.error_param(loc)
    target = f"'{param}'" if param else "the request body"
    return errors.OpenAIError(
        400,
        f"Invalid value for {target}: the string contains an unpaired UTF-16 surrogate "
        "escape (\\ud800-\\udfff) and is not valid Unicode text.",
        param=param,
        code="invalid_value",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes, within `--request-read-timeout`, as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.partition(";")[0].strip().lower()
        if not _JSON_MEDIA_TYPE.match(media_type):
            raise errors.unsupported_media_type(media_type)
    timeout = gateway_of(request).config.request_read_timeout
    try:
        async with asyncio.timeout(timeout):
            return await _read_limited(request, limit)
    except TimeoutError:
        raise errors.request_timeout(timeout) from None
    except ClientDisconnect:
        raise errors.ClientGone() from None


async def _read_limited(request: Request, limit: int) -> bytes:
    """Keep at most `limit` bytes; past it, read and drop up to `_DISCARD_FACTOR` times the
    limit (so the client is listening when its 413 comes), then refuse."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit * _DISCARD_FACTOR:
            break
    if size > limit:
        raise errors.payload_too_large(limit)
    return b"".join(chunks)


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway
