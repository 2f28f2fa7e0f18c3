"""Sending one planned exchange and reading what comes back: a stream event by event (the
client may leave mid-stream on purpose), a plain body whole (or an early client timeout).
Every exchange is bounded; what arrives is judged by `checks`."""

from __future__ import annotations

import asyncio

import httpx

from tools.soak.checks import judge_body, judge_chunk
from tools.soak.config import Target
from tools.soak.exchange import Outcome, PlannedRequest


def http_client(target: Target, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=target.url,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=limits,
        trust_env=False,
    )


async def execute(client: httpx.AsyncClient, req: PlannedRequest, timeout_s: float) -> Outcome:
    """Send `req` and judge what came back; bounded by `timeout_s` in all."""
    try:
        async with asyncio.timeout(timeout_s):
            if req.stream:
                return await _stream(client, req)
            return await _plain(client, req)
    except TimeoutError:
        return Outcome(
            result="timed_out", problems=[f"{req.kind}: unfinished after {timeout_s:g} s"]
        )
    except httpx.TransportError as exc:
        return Outcome(
            result="transport_error", problems=[f"{req.kind}: {type(exc).__name__}: {exc}"]
        )


async def _plain(client: httpx.AsyncClient, req: PlannedRequest) -> Outcome:
    try:
        async with asyncio.timeout(req.client_timeout_s):
            response = await client.request(
                req.method, req.path, content=req.body, headers=req.headers
            )
    except TimeoutError:
        if req.client_timeout_s is None:
            raise
        return Outcome(result="nonstream_cut")
    outcome = Outcome(status=response.status_code)
    judge_body(req, response.status_code, response.content, outcome)
    return outcome


async def _stream(client: httpx.AsyncClient, req: PlannedRequest) -> Outcome:
    async with client.stream(
        req.method, req.path, content=req.body, headers=req.headers
    ) as response:
        outcome = Outcome(status=response.status_code)
        if response.status_code != 200:
            judge_body(req, response.status_code, await response.aread(), outcome)
            return outcome
        if req.cut_after == 0:
            outcome.result = "cut"
            return outcome
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": ping" comments
            payload = line[5:].strip()
            if payload == "[DONE]":
                return outcome
            judge_chunk(req, payload, outcome)
            events += 1
            if req.cut_after is not None and events >= req.cut_after:
                outcome.result = "cut"
                return outcome  # leaving the block closes the connection mid-stream
    outcome.broken_stream = True
    outcome.problems.append(f"{req.kind}: stream ended without [DONE] after {events} events")
    return outcome
