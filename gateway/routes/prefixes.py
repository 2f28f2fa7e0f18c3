"""Registry admin: list prefixes with stats, reload the file, explain a (non-)match."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import EngineStats, MatchReport, SamplingParams
from gateway import errors
from gateway.admission import gateway_of, parse_json, read_body
from gateway.engine_client import EngineClient, ReplicaSetView
from gateway.protocol.admin import (
    Divergence,
    MatchResponse,
    PrefixCard,
    PrefixDefaults,
    PrefixList,
    ReloadResponse,
    ReloadState,
    ReplicaCard,
)
from gateway.routes.common import chat_or_completion, first_prompt_ids, prepare_requests


async def list_prefixes(request: Request) -> Response:
    """The entries the caller may hit (a tenant does not learn of others' entries)."""
    gateway = gateway_of(request)
    caller = gateway.check_auth(request, access="read")
    stats = gateway.ready_engine().stats()
    listing = PrefixList(
        data=[
            PrefixCard(
                name=p.name,
                description=p.description,
                kind=p.kind,
                tokens=p.num_tokens,
                blocks=p.num_blocks,
                partial_tail_block=p.is_tail_partial,
                hits=p.num_hits,
                cached_tokens=p.num_cached_tokens,
                last_hit=p.last_hit_time,
                response_format=(
                    json.loads(p.contract.response_format) if p.contract.response_format else None
                ),
                defaults=PrefixDefaults(
                    temperature=p.contract.temperature,
                    max_tokens=p.contract.max_tokens,
                    stop=list(p.contract.stop) if p.contract.stop is not None else None,
                ),
                tenants=list(p.tenants) if p.tenants is not None and caller.is_admin else None,
            )
            for p in stats.prefixes
            if caller.sees(p.tenants)
        ],
        enabled=gateway.config.engine.enable_prefix_cache,
        lookups=stats.prefix_lookups,
        hits=stats.prefix_hits,
        cached_tokens=stats.prefix_cached_tokens,
        digest=stats.registry_digest,
        last_reload=_reload_state(stats),
        replicas=_replica_cards(gateway.replicas) if caller.is_admin else None,
    )
    return JSONResponse(listing.model_dump(mode="json"))


def _reload_state(stats: EngineStats) -> ReloadState:
    return ReloadState(
        time=stats.last_reload_time,
        ok=stats.last_reload_ok,
        error=stats.last_reload_error,
        pending=stats.is_reload_pending,
    )


def _replica_cards(replicas: ReplicaSetView | None) -> list[ReplicaCard] | None:
    """Each replica's registry (admin only: replica names are the operator's business)."""
    if replicas is None:
        return None
    return [
        ReplicaCard(
            name=r.name,
            pid=r.pid,
            streaming=r.streaming,
            digest=r.stats.registry_digest if r.stats else None,
            prefixes=len(r.stats.prefixes) if r.stats else None,
            lookups=r.stats.prefix_lookups if r.stats else None,
            hits=r.stats.prefix_hits if r.stats else None,
            last_reload=_reload_state(r.stats) if r.stats else None,
            error=r.error,
        )
        for r in replicas.replica_states()
    ]


async def reload_prefixes(request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_auth(request, access="admin")
    status = await gateway.ready_engine().reload_prefixes()
    if not status.ok:
        raise errors.OpenAIError(
            400,
            f"reload failed, the previous registry keeps serving: {status.error}",
            "invalid_request_error",
            None,
            "prefix_reload_failed",
        )
    reloaded = ReloadResponse(time=status.time, prefixes=status.num_prefixes)
    return JSONResponse(reloaded.model_dump(mode="json"))


async def match_prefix(request: Request) -> Response:
    """Body: a chat (`messages`) or completion (`prompt`) request, as a client would send it;
    the answer is what that request would get from this caller (its tenant's entries, its
    cache scope)."""
    gateway = gateway_of(request)
    caller = gateway.check_auth(request, access="read")
    engine = gateway.ready_engine()
    raw = await read_body(request, gateway.config.max_request_bytes)
    ids, cache_salt = await gateway.run_blocking(_prompt_ids, engine, raw)
    # Explained as this caller's own request would be served: its tenant's entries and scope.
    report = await engine.explain_prefix_match(
        ids, caller.cache_salt(cache_salt), caller.tenant_name
    )
    return JSONResponse(_describe(report, engine.tokenizer))


def _prompt_ids(engine: EngineClient, raw: bytes) -> tuple[list[int], str | None]:
    """The first prompt's token ids, tokenized as the generation routes do (worker pool),
    and checked by the engine like any prompt (ids in the vocabulary, length); and the
    request's cache scope."""
    request = chat_or_completion(parse_json(raw))
    field, ids = first_prompt_ids(engine, request)
    prepare_requests(engine, [ids], lambda _: SamplingParams(max_tokens=1), {"prompt": field})
    return ids, request.cache_salt


def _describe(report: MatchReport, tokenizer: Any) -> dict[str, Any]:
    closest = None
    if report.closest is not None and report.diverged_at is not None:
        closest = Divergence(
            name=report.closest,
            diverged_at=report.diverged_at,
            prefix_token=_text(tokenizer, report.prefix_token_id),
            prompt_token=_text(tokenizer, report.prompt_token_id),
        )
    match = MatchResponse(
        prompt_tokens=report.num_prompt_tokens,
        matched=report.matched,
        matched_tokens=report.num_matched_tokens,
        closest=closest,
        cached_tokens=report.num_cached_tokens,
        cache_source=report.cache_source,
    )
    return match.model_dump(mode="json")


def _text(tokenizer: Any, token_id: int | None) -> str | None:
    return None if token_id is None else str(tokenizer.decode([token_id]))
