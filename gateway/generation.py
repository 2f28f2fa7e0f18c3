"""Running one API request as n engine requests, and turning engine outputs into API pieces.

Shared by the chat and completion routes: fan-out over choices, metrics timing, the waiting
count used for backpressure, and logprob conversion.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from engine import EngineRequest, RequestOutput, SampleLogprobs
from gateway.engine_client import EngineClient
from gateway.state import Gateway
from gateway.waiting import Ticket


@dataclass(slots=True)
class Choice:
    """Everything one choice produced, accumulated over the stream."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # per token: where its text starts
    prompt_logprobs: list[SampleLogprobs | None] | None = None  # when the request scored it
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_written_tokens: int = 0
    is_started: bool = False

    def add(self, out: RequestOutput) -> None:
        self.is_started = True
        self.text_offsets += [len(self.text) + o for o in out.offsets()]
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_cache_written_tokens = out.num_cache_written_tokens


@dataclass(slots=True)
class Job:
    """One API request's engine requests (one per choice) and their timing. Each choice's
    first output releases its place in the ticket's waiting count."""

    gateway: Gateway
    engine: EngineClient
    ticket: Ticket
    request_id: str  # the API response's id
    requests: list[EngineRequest]  # per choice (several prompts fan out too)
    affinity_key: str | None = None  # the client's prompt_cache_key or user (replica routing)
    # The HTTP request's x-request-id (the client's own when it sent one): the engine request
    # of choice i is "{x_request_id}-{i}-{8 hex digits of this job's}", so the engine's log
    # lines name what the client sees, and two requests that send the same header (a proxy's
    # fixed id, a retry) are still two engine requests, not a "duplicate request id" error
    x_request_id: str | None = None
    _unique: str = field(default_factory=lambda: uuid.uuid4().hex[:8], init=False)
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(len(self.requests))]

    async def run(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Merge the choices' streams; each output comes with its (updated) Choice."""
        if any(
            r.params.logprobs is not None or r.params.prompt_logprobs is not None
            for r in self.requests
        ):
            await self.gateway.logprob_texts_ready()  # the outputs' logprobs name tokens by text
        try:
            async for index, out in _merge(self._streams()):
                choice = self.choices[index]
                if not choice.is_started:
                    self.ticket.started()
                if self.first_token is None:
                    self.first_token = time.perf_counter()
                choice.add(out)
                yield choice, out
        finally:
            self._observe()

    async def collect(self) -> None:
        async for _ in self.run():
            pass

    def _streams(self) -> list[AsyncIterator[RequestOutput]]:
        base = self.x_request_id or self.request_id
        return [
            self.engine.generate(request, f"{base}-{i}-{self._unique}", self.affinity_key)
            for i, request in enumerate(self.requests)
        ]

    def _observe(self) -> None:
        if self.first_token is None or not all(c.finish_reason for c in self.choices):
            return
        metrics, end = self.gateway.metrics, time.perf_counter()
        metrics.observe_ttft(self.first_token - self.started)
        metrics.observe_e2e(end - self.started)
        num_out = max(len(c.token_ids) for c in self.choices)
        if num_out > 1:
            metrics.observe_tpot((end - self.first_token) / (num_out - 1))
        metrics.observe_tokens(
            self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens
        )

    # -- usage: prompt tokens count once per prompt, as OpenAI does for n > 1 ---------------------
    @property
    def prompts(self) -> list[list[int]]:
        return [request.prompt_token_ids for request in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in _distinct(self.prompts))

    @property
    def num_cached_tokens(self) -> int:
        firsts: dict[tuple[int, ...], int] = {}
        for prompt, choice in zip(self.prompts, self.choices, strict=True):
            firsts.setdefault(tuple(prompt), choice.num_cached_tokens)
        return sum(firsts.values())

    @property
    def num_cache_written_tokens(self) -> int:
        """Choices of one prompt share its blocks: one of them wrote them."""
        return sum(c.num_cache_written_tokens for c in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def fan_out(request: EngineRequest, n: int) -> list[EngineRequest]:
    """n choices of one prepared request; a seeded one gets seed, seed+1, ... so they differ."""
    params = request.params
    if params.seed is None:
        return [request] * n
    return [request.with_params(replace(params, seed=(params.seed + i) % 2**63)) for i in range(n)]


def _distinct(prompts: list[list[int]]) -> list[list[int]]:
    seen: dict[tuple[int, ...], list[int]] = {}
    for prompt in prompts:
        seen.setdefault(tuple(prompt), prompt)
    return list(seen.values())


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams; closing this closes (and so aborts) every one."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
