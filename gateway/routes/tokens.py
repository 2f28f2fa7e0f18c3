"""POST /tokenize and POST /detokenize: the served tokenizer, for clients that need its ids
(a `logit_bias`, a context budget) or its text for ids (vLLM's and llama.cpp's routes).

/tokenize takes a chat or a completion body as /v1/prefixes/match does and answers the prompt
the model would read, through the same rendering as the generation routes (worker pool).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import InvalidRequestError
from gateway import errors
from gateway.admission import gateway_of, parse_json, read_body
from gateway.engine_client import EngineClient
from gateway.protocol.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from gateway.routes.common import chat_or_completion, first_prompt_ids


async def tokenize(request: Request) -> Response:
    return await _answer(request, _tokenize)


async def detokenize(request: Request) -> Response:
    return await _answer(request, _detokenize)


async def _answer(
    request: Request,
    work: Callable[[EngineClient, Callable[[str], None], bytes], BaseModel],
) -> Response:
    """`work`'s answer to the body, computed in the worker pool (parsing, validating,
    tokenizing or decoding a large body would stall the event loop)."""
    gateway = gateway_of(request)
    gateway.check_auth(request)
    engine = gateway.ready_engine()
    raw = await read_body(request, gateway.config.max_request_bytes)
    body = await gateway.run_blocking(work, engine, gateway.check_model, raw)
    return JSONResponse(body.model_dump(mode="json"))


def _tokenize(
    engine: EngineClient, check_model: Callable[[str], None], raw: bytes
) -> TokenizeResponse:
    request = chat_or_completion(parse_json(raw), TokenizeChatRequest, TokenizeCompletionRequest)
    if request.model is not None:  # left out: the served one, as on vLLM's route
        check_model(request.model)
    _, ids = first_prompt_ids(engine, request)
    _check_ids(ids, engine, "prompt")
    return TokenizeResponse(
        count=len(ids),
        max_model_len=engine.max_model_len,
        tokens=ids,
        token_strs=[str(t) for t in engine.tokenizer.convert_ids_to_tokens(ids)],
    )


def _detokenize(
    engine: EngineClient, check_model: Callable[[str], None], raw: bytes
) -> DetokenizeResponse:
    body = errors.validate(DetokenizeRequest, parse_json(raw))
    if body.model is not None:
        check_model(body.model)
    _check_ids(body.tokens, engine, "tokens")
    return DetokenizeResponse(prompt=str(engine.tokenizer.decode(body.tokens)))


def _check_ids(ids: list[int], engine: EngineClient, param: str) -> None:
    """Ids the tokenizer has (a model's head may be wider than its vocabulary)."""
    vocab_size = len(engine.tokenizer)
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(
            f"token ids must be in [0, {vocab_size})", param=param, code="invalid_token_id"
        )
