"""The request router of the engine deployment: honor the ingress's preferred replica.

The ingress decides affinity (it knows which replica served each conversation and how many
requests each replica holds, see `replicas.affinity`) and names its choice in the request's
`session_id`; an empty one means "no preference". This router, run by Ray Serve inside the
ingress process, turns that into ranks: the preferred replica first, the others after it, so
Serve still falls through to the others when the preferred one's queue is full. The ingress
names a replica whenever it knows one; without a preference (before any replica has reported)
it is power of two choices: two random replicas, and Serve probes both and takes the one with
fewer requests in flight (running + waiting in its engine).

Stateless on purpose: Serve builds a router per handle and may rebuild it.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PreferredReplicaRouter(RequestRouter):
    """No FIFOMixin: it would hand the replica chosen for one request to whichever request
    waited longest, and affinity would follow the queue instead of the conversation; the
    base class gives each request the replica chosen for it."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        preferred = pending_request.metadata.session_id if pending_request is not None else ""
        return rank_replicas(candidate_replicas, preferred)


def rank_replicas(
    candidates: list[RunningReplica], preferred: str, rng: random.Random | None = None
) -> list[list[RunningReplica]]:
    """[[preferred], two others] when `preferred` (a replica's unique id) is a candidate,
    else [two random candidates]: Serve takes the least loaded of each rank in turn."""
    rng = rng or random._inst
    chosen = [r for r in candidates if r.replica_id.unique_id == preferred]
    others = [r for r in candidates if r.replica_id.unique_id != preferred]
    two = rng.sample(others, min(2, len(others)))
    if chosen:
        return [chosen, two] if two else [chosen]
    return [two] if two else []
