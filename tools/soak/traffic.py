"""The request mix and the workers that send it. Request `index` is drawn from
`random.Random(f"{seed}:{index}")` alone, so a seed replays the same mix whatever the timing;
`concurrency` workers keep that many requests in flight (a closed loop, so how many long
requests overlap does not depend on the machine's speed)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from tools.soak.client import execute
from tools.soak.config import LoadSettings, SoakConfig, Target
from tools.soak.exchange import CHAT_PATH, TEXT_PATH, PlannedRequest, post_json
from tools.soak.hostile import hostile_cases
from tools.soak.prefixes import VERSIONS, Entry, entry_pool
from tools.soak.results import SoakResult, record

# Tokens a long request leaves for its prompt: the longest soak prompt (a pool entry as the
# system message, a question and the chat template) stays under it with either model.
LONG_PROMPT_ROOM = 96
QUESTIONS = (
    "What is the capital of France?",
    "Hello there! How are you today?",
    "How does a paged cache store keys?",
    "Numbers like 1 2 3 and 42 appear in text too.",
)
PROMPTS = (
    "The quick brown fox",
    "In the beginning there was a small model, and",
    "She sells sea shells by the sea shore,",
    "Café naïve résumé 日本語 😀",
)


def long_max_tokens(load: LoadSettings, max_model_len: int) -> int:
    """--long-max-tokens, else half the context (leaving LONG_PROMPT_ROOM for the prompt):
    long enough that a few such requests fill a small pool, short enough to finish often."""
    default = min(max_model_len // 2, max_model_len - LONG_PROMPT_ROOM)
    return load.long_max_tokens or max(8, default)


def plan_request(
    index: int,
    seed: int,
    load: LoadSettings,
    target: Target,
    hostiles: Sequence[PlannedRequest],
) -> PlannedRequest:
    """Request `index` of the run: the same seed gives the same request, whatever ran before.
    The order of the draws is part of what a seed replays: change it and old seeds change."""
    rng = random.Random(f"{seed}:{index}")
    if rng.random() < load.hostile_rate:
        return rng.choice(hostiles)
    cut = rng.random() < load.disconnect_rate
    stream = rng.random() < load.stream_rate
    # A non-streaming cut asks for a long answer: the client must leave before it is ready.
    long = rng.random() < load.long_rate or (cut and not stream)
    max_tokens = (
        long_max_tokens(load, target.max_model_len)
        if long
        else rng.randint(2, load.short_max_tokens)
    )
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": stream}
    body["ignore_eos"] = long or cut  # a stream to cut must still be running when it is cut
    _sampling(body, rng, stream)
    route = rng.choice(("chat", "completion"))
    if route == "chat":
        body["messages"] = _messages(rng, entry_pool())
    else:
        body["prompt"] = _prompt(rng, entry_pool())
    return post_json(
        route,
        CHAT_PATH if route == "chat" else TEXT_PATH,
        body,
        target,
        stream=stream,
        cut_after=rng.randint(0, max(0, max_tokens // 2)) if cut and stream else None,
        client_timeout_s=rng.uniform(0.05, 0.5) if cut and not stream else None,
        long=long,
    )


def _sampling(body: dict[str, Any], rng: random.Random, stream: bool) -> None:
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 1000))
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if not stream and rng.random() < 0.15:
        body["n"] = 2


def _messages(rng: random.Random, pool: Sequence[Entry]) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.6:  # a pool entry's system prompt: a prefix hit when it is registered
        entry = rng.choice([e for e in pool if e.kind == "chat"])
        content = entry.at_version(rng.randrange(VERSIONS)).content
        messages.append({"role": "system", "content": content})
    messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
    return messages


def _prompt(rng: random.Random, pool: Sequence[Entry]) -> str:
    if rng.random() < 0.6:
        entry = rng.choice([e for e in pool if e.kind == "text"])
        content = entry.at_version(rng.randrange(VERSIONS)).content
        return f"{content} {rng.choice(PROMPTS)}"
    return rng.choice(PROMPTS)


def probe_request(entry: Entry, target: Target) -> PlannedRequest:
    """A one-token request that starts with `entry`: a hit on it while it is registered."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": 1, "temperature": 0}
    if entry.kind == "chat":
        body["messages"] = [
            {"role": "system", "content": entry.content},
            {"role": "user", "content": "Hello"},
        ]
        return post_json("probe", CHAT_PATH, body, target)
    body["prompt"] = f"{entry.content} Hello"
    return post_json("probe", TEXT_PATH, body, target)


def final_request(target: Target) -> PlannedRequest:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    body = {"model": target.model, "max_tokens": 4, "messages": messages}
    return post_json("final", CHAT_PATH, body, target)


async def run_load(
    config: SoakConfig,
    target: Target,
    client: httpx.AsyncClient,
    result: SoakResult,
    deadline: float,
) -> None:
    """`concurrency` workers take the next request index until max_requests or the deadline;
    requests in flight at the deadline finish (each bounded by --request-timeout)."""
    load, indices = config.load, iter(range(config.load.max_requests))
    hostiles = hostile_cases(target)

    async def worker() -> None:
        for index in indices:  # shared: each worker takes the next index when it is free
            if time.monotonic() >= deadline:
                return
            req = plan_request(index, config.seed, load, target, hostiles)
            record(result, req, await execute(client, req, load.request_timeout_s), is_load=True)

    async with asyncio.TaskGroup() as group:
        for _ in range(load.concurrency):
            group.create_task(worker())
