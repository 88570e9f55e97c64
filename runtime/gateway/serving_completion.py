"""``POST /v1/completions``: prompts in, text (or an SSE stream of text deltas) out."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from deepinfer.runtime.gateway.config import STATE_KEY, GatewayState
from deepinfer.runtime.gateway.errors import GatewayError, error_payload
from deepinfer.runtime.gateway.generation import Generation
from deepinfer.runtime.gateway.openai_protocol import CompletionRequest
from deepinfer.runtime.gateway.openai_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    completion_logprobs,
    encoder,
    make_usage,
)
from deepinfer.runtime.gateway.prompts import completion_prompts, num_prompts
from deepinfer.runtime.gateway.serving_common import (
    admitted,
    check_n,
    decode_body,
    engine_requests,
    is_silent_delta,
    new_request_id,
    served_model,
    token_namer,
)
from deepinfer.runtime.gateway.sse import ClientGone, SSEWriter

log = logging.getLogger(__name__)


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    req: CompletionRequest = await decode_body(request, CompletionRequest)
    model = served_model(state, req.model)
    check_n(state, req.n, num_prompts(req.prompt))  # before tokenizing a batch that cannot be served
    prompts = await completion_prompts(req.prompt, state.engine.tokenizer)
    request_id = new_request_id("cmpl")
    requests, structured = engine_requests(
        state, req, request_id, prompts, logprobs=req.logprobs,
        default_max_tokens=state.config.default_completion_max_tokens, prompt_param="prompt")
    async with admitted(state):
        gen = Generation(state.engine, requests, state.metrics, arrival_time=arrival,
                         structured_param=structured.param if structured else None, prompt_param="prompt")
        try:
            await gen.start()
            if req.stream:
                return await _stream(request, state, req, gen, request_id, model)
            return await _full(state, req, gen, request_id, model)
        finally:
            await gen.close()


async def _full(state: GatewayState, req: CompletionRequest, gen: Generation, request_id: str,
                model: str) -> web.Response:
    async for _ in gen.deltas():
        pass
    token_text = token_namer(state.engine.tokenizer)
    choices = []
    for c in gen.choices:
        logprobs = None
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, req.logprobs, token_text, 0)
        choices.append(CompletionChoice(c.index, c.text, logprobs, c.finish_reason, c.stop_reason))
    resp = CompletionResponse(request_id, int(time.time()), model, choices, make_usage(*gen.usage_counts()))
    return web.Response(body=encoder.encode(resp), content_type="application/json")


async def _stream(request: web.Request, state: GatewayState, req: CompletionRequest, gen: Generation,
                  request_id: str, model: str) -> web.StreamResponse:
    sse = SSEWriter(request)
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    created = int(time.time())
    token_text = token_namer(state.engine.tokenizer)
    text_offsets = [0] * len(gen.choices)
    try:
        await sse.start()
        async for choice, delta in gen.deltas():
            if is_silent_delta(delta.text, delta.finish_reason, len(delta.token_ids) if req.logprobs is not None else 0):
                continue
            logprobs: CompletionLogprobs | None = None
            if req.logprobs is not None:
                logprobs, text_offsets[choice.index] = completion_logprobs(
                    delta.token_ids, delta.logprobs or [], req.logprobs, token_text, text_offsets[choice.index])
            chunk = CompletionResponse(
                request_id, created, model,
                [CompletionChoice(choice.index, delta.text, logprobs, delta.finish_reason, delta.stop_reason)])
            if include_usage:
                chunk.usage = make_usage(*gen.usage_counts()) if continuous else None
            sse.add(encoder.encode(chunk))
            if not gen.has_ready:
                await sse.flush()
        if include_usage:
            await sse.send(encoder.encode(CompletionResponse(request_id, created, model, [],
                                                             make_usage(*gen.usage_counts()))))
        await sse.done()
    except ClientGone:
        log.debug("client left while streaming %s; aborting", request_id)
    except GatewayError as err:  # the engine failed mid-stream: tell the client in-band
        await sse.fail(error_payload(err))
    except Exception:
        log.exception("error while streaming %s", request_id)
        await sse.fail(error_payload(GatewayError("internal error while streaming", status=500, code="internal_error")))
    return sse.response
