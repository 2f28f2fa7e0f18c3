"""Bodies of prefixgate's own routes (registry admin, health): typed so that the routes
serialise through them and the OpenAPI document describes exactly what they send."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class PrefixDefaults(BaseModel):
    """Sampling defaults an entry gives the requests that hit it (null: not set)."""

    temperature: float | None
    max_tokens: int | None
    stop: list[str] | None


class PrefixCard(BaseModel):
    name: str
    description: str | None
    kind: str  # "messages" or "text"
    tokens: int
    blocks: int
    partial_tail_block: bool
    hits: int
    cached_tokens: int
    last_hit: float | None
    response_format: dict[str, Any] | None  # as in the file, compiled at load
    defaults: PrefixDefaults
    tenants: list[str] | None = None  # the entry's `tenants:` (shown to the admin only)


class ReloadState(BaseModel):
    time: float | None
    ok: bool | None
    error: str | None
    pending: bool


class ReplicaCard(BaseModel):
    """One engine replica (Ray Serve): the registry it holds, its last reload, its hits;
    `error` when it did not answer the ingress's last poll. `pid`: its worker process;
    `streaming`: the requests it has taken that have not ended, as the ingress counts them
    now (the other counts are as of the ingress's last poll)."""

    name: str
    pid: int | None
    streaming: int
    digest: str | None
    prefixes: int | None
    lookups: int | None  # prompts it checked against the registry: the requests it served
    hits: int | None
    last_reload: ReloadState | None
    error: str | None = None


class PrefixList(BaseModel):
    """The registry; on Ray Serve, `hits` and the entries' counts add up over `replicas`,
    and `digest` is "mixed" while they do not all hold the same registry."""

    object: Literal["list"] = "list"
    data: list[PrefixCard]
    enabled: bool
    lookups: int
    hits: int
    cached_tokens: int
    digest: str  # of every entry's name, token ids and tenants: equal digests, equal registries
    last_reload: ReloadState
    replicas: list[ReplicaCard] | None = None  # Ray Serve only


class ReloadResponse(BaseModel):
    ok: Literal[True] = True
    time: float | None
    prefixes: int


class Divergence(BaseModel):
    name: str
    diverged_at: int
    prefix_token: str | None
    prompt_token: str | None


class MatchResponse(BaseModel):
    """`matched`/`closest`: the registry's view. `cached_tokens`: what the prefix cache would
    share with this prompt now, and `cache_source` where from: "registry" (a whole entry),
    "registry-partial" (an entry's full blocks before the prompt diverged) or "auto" (blocks
    computed earlier in the request's cache scope); null when nothing."""

    prompt_tokens: int
    matched: str | None
    matched_tokens: int
    closest: Divergence | None
    cached_tokens: int = 0
    cache_source: str | None = None


class HealthResponse(BaseModel):
    """`degraded`: serving, with something short that `detail` names (on Ray Serve, an
    engine replica restarting or not answering)."""

    status: Literal["ok", "degraded"] = "ok"
    model: str
    detail: str | None = None
    # The C++ CPU kernels' target ("avx512", "avx2", "portable"), or "off" (torch paths)
    cpu_kernels: str | None = None
