"""GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.admission import gateway_of
from gateway.protocol import ModelCard, ModelList
from gateway.protocol.admin import HealthResponse


async def list_models(request: Request) -> Response:
    return JSONResponse(ModelList(data=[_served_model(request)]).model_dump(mode="json"))


async def retrieve_model(request: Request) -> Response:
    """The served model's card; any other id is a 404 model_not_found."""
    card = _served_model(request)
    name = request.path_params["model"]
    if name != card.id:
        raise errors.unknown_model(name)
    return JSONResponse(card.model_dump(mode="json"))


def _served_model(request: Request) -> ModelCard:
    gateway = gateway_of(request)
    gateway.check_auth(request)
    gateway.ready_engine()
    return ModelCard(
        id=gateway.model_name, created=gateway.created, max_model_len=gateway.max_model_len
    )


async def health(request: Request) -> Response:
    """200 once the model is loaded and every registry prefix is filled; 503 before. On Ray
    Serve: 503 while the replicas that answer hold different registry digests (a reload
    under way or failed on some), 200 "degraded" while some replica is restarting."""
    gateway = gateway_of(request)
    if gateway.is_draining:
        raise errors.shutting_down()
    if not gateway.is_ready:
        raise errors.not_ready(gateway.load_error)
    replicas = gateway.replica_health()
    if replicas.problem is not None:  # Ray Serve: the replicas must serve the same registry
        raise errors.not_ready(replicas.problem)
    health = HealthResponse(
        status="degraded" if replicas.degraded else "ok",
        model=gateway.model_name,
        detail=replicas.degraded,
        cpu_kernels=gateway.cpu_kernels,
    )
    return JSONResponse(health.model_dump(mode="json", exclude_none=True))


async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_metrics_auth(request)
    body, content_type = gateway.metrics.render()
    return Response(body, media_type=content_type)
