"""GET /v1/models, GET /health, GET /metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.admission import gateway_of
from gateway.protocol import ModelCard, ModelList
from gateway.protocol.admin import HealthResponse


async def list_models(request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_auth(request)
    gateway.ready_engine()
    card = ModelCard(
        id=gateway.model_name, created=gateway.created, max_model_len=gateway.max_model_len
    )
    return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))


async def health(request: Request) -> Response:
    """200 once the model is loaded and every registry prefix is filled; 503 before."""
    gateway = gateway_of(request)
    if gateway.is_draining:
        raise errors.shutting_down()
    if not gateway.is_ready:
        raise errors.not_ready(gateway.load_error)
    return JSONResponse(HealthResponse(model=gateway.model_name).model_dump(mode="json"))


async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_metrics_auth(request)
    body, content_type = gateway.metrics.render()
    return Response(body, media_type=content_type)
