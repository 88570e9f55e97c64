"""Steps both generation endpoints share: read + decode the body, check the model and the limits,
admit the request (429 when full), build the engine requests, name tokens for logprobs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from deepinfer.engine.api.protocol import GatewayTokenizer
from deepinfer.engine.api.sampling_params import choice_params
from deepinfer.runtime.gateway.config import GatewayState
from deepinfer.runtime.gateway.engine_inputs import (
    StructuredSpec,
    decide_max_tokens,
    requested_max_tokens,
    sampling_params,
    stop_strings,
    structured_spec,
)
from deepinfer.runtime.gateway.errors import GatewayError, bad_request, echo, from_decode_error
from deepinfer.runtime.gateway.generation import EngineRequest
from deepinfer.runtime.gateway.openai_protocol import SamplingRequest, decode_request, unsupported_fields
from deepinfer.runtime.gateway.openai_responses import TokenBytes, TokenText, text_bytes


async def decode_body(request: web.Request, kind: type[SamplingRequest]) -> SamplingRequest:
    body = await request.read()  # raises HTTPRequestEntityTooLarge (413) past client_max_size
    try:
        req = decode_request(body, kind)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise from_decode_error(exc) from None
    unsupported = unsupported_fields(req)
    if unsupported is not None:
        field, why = unsupported
        raise bad_request(why, field, code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed together with stream=true", "stream_options")
    return req


def served_model(state: GatewayState, model: str | None) -> str:
    if model is None:
        return state.model_names[0]
    if model not in state.model_names:
        raise GatewayError(f"the model {echo(model)} does not exist; this server serves {', '.join(state.model_names)}",
                           status=404, param="model", code="model_not_found")
    return model


def check_n(state: GatewayState, n: int, num_prompts: int) -> None:
    cfg = state.config
    if n > cfg.max_n:
        raise bad_request(f"n must be between 1 and {cfg.max_n}, got {n}", "n")
    if n * num_prompts > cfg.max_choices:
        raise bad_request(f"prompts x n must be at most {cfg.max_choices}, got {num_prompts} x {n}", "n")


@contextlib.asynccontextmanager
async def admitted(state: GatewayState) -> AsyncIterator[None]:
    """Count the request as in flight; 429 when the gateway serves its maximum (a full engine
    queue is the engine's to refuse: its EngineOverloadedError maps to 429 in errors.py)."""
    cfg = state.config
    retry = {"Retry-After": str(cfg.retry_after_s)}
    if cfg.max_concurrent_requests is not None and state.num_in_flight >= cfg.max_concurrent_requests:
        raise GatewayError(f"the server is serving its maximum of {cfg.max_concurrent_requests} requests; retry "
                           "shortly", status=429, code="too_many_requests", headers=retry)
    state.num_in_flight += 1
    state.metrics.in_flight.inc()
    try:
        yield
    finally:
        state.num_in_flight -= 1
        state.metrics.in_flight.dec()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_requests(
    state: GatewayState,
    req: SamplingRequest,
    request_id: str,
    prompts: list[list[int]],
    *,
    logprobs: int | None,
    default_max_tokens: int | None,
    prompt_param: str,
    prompt_logprobs: int | None = None,
    client_request_id: str | None = None,
) -> tuple[list[EngineRequest], StructuredSpec | None]:
    """One engine request per (prompt, choice); choice index = prompt * n + i, seed = seed + i.
    Engine ids are ``[client_request_id.]request_id-index`` (response_wire.py: the client's id leads)."""
    check_n(state, req.n, len(prompts))
    structured = structured_spec(req)
    stop = stop_strings(req, state.config.max_stop_strings)
    requested, requested_param = requested_max_tokens(req)
    max_model_len = state.engine.model_info.max_model_len
    out = []
    for p, ids in enumerate(prompts):
        max_tokens = decide_max_tokens(len(ids), requested, requested_param, default_max_tokens, max_model_len,
                                       prompt_param)
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, structured=structured, stop=stop,
                                 prompt_logprobs=prompt_logprobs)
        lead = f"{client_request_id}.{request_id}" if client_request_id else request_id
        for i in range(req.n):
            index = p * req.n + i
            child = params if req.n == 1 else choice_params(params, i)
            out.append(EngineRequest(index, p, f"{lead}-{index}", ids, child))
    return out, structured


def token_namer(tokenizer: GatewayTokenizer | None) -> TokenText:
    """Text of a token for logprobs: the engine's decoded text, else one-token decode (cached)."""
    cache: dict[int, str] = {}

    def token_text(token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        text = cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"token_id:{token_id}"
            cache[token_id] = text
        return text

    return token_text


def token_byte_namer(tokenizer: GatewayTokenizer | None) -> TokenBytes:
    """Raw bytes of a token for chat logprobs: the tokenizer's (a byte fragment has no text of
    its own), else the bytes of its text."""
    if tokenizer is None:
        return text_bytes

    def token_bytes(token_id: int, text: str) -> list[int]:
        return list(tokenizer.token_bytes(token_id))

    return token_bytes


def is_silent_delta(text: str, finish_reason: str | None, num_logprob_tokens: int) -> bool:
    """A delta with nothing to show (tokens whose text is held back or still incomplete UTF-8)."""
    return not text and finish_reason is None and num_logprob_tokens == 0
