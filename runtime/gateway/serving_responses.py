"""``POST /v1/responses``: a Responses request served through the chat path (responses_request.py, responses_api.py)."""

from __future__ import annotations

import logging
import time

import msgspec
from aiohttp import web

from deepinfer.runtime.gateway.chat_output import ChatOutputParser
from deepinfer.runtime.gateway.chat_request import PreparedChat, prepare_chat
from deepinfer.runtime.gateway.config import STATE_KEY
from deepinfer.runtime.gateway.errors import GatewayError, error_payload, from_decode_error
from deepinfer.runtime.gateway.generation import Generation
from deepinfer.runtime.gateway.openai_protocol import decode_request
from deepinfer.runtime.gateway.openai_responses import encoder
from deepinfer.runtime.gateway.reasoning import think_tokens
from deepinfer.runtime.gateway.response_wire import ClientGone, SSEWriter
from deepinfer.runtime.gateway.response_wire import request_id as client_request_id
from deepinfer.runtime.gateway.responses_api import (
    ResponseBuilder,
    make_response_usage,
    new_response,
)
from deepinfer.runtime.gateway.responses_request import ResponsesRequest, to_chat_request
from deepinfer.runtime.gateway.serving_common import admitted, engine_requests, served_model

log = logging.getLogger(__name__)


async def create_response(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    try:
        req: ResponsesRequest = decode_request(await request.read(), ResponsesRequest)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise from_decode_error(exc) from None
    model = served_model(state, req.model)
    prepared = await prepare_chat(state, to_chat_request(req))
    builder = ResponseBuilder(new_response(req, model))
    requests, structured = engine_requests(state, prepared.request, builder.response.id,
                                           [prepared.prompt_token_ids], logprobs=None, default_max_tokens=None,
                                           prompt_param="input", client_request_id=client_request_id(request))
    async with admitted(state):
        gen = Generation(state.engine, requests, state.metrics, arrival_time=arrival,
                         structured_param=structured.param if structured else None, prompt_param="input")
        try:
            await gen.start()
            if req.stream:
                return await _stream(request, prepared, gen, builder)
            parser = ChatOutputParser(prepared.mode)
            async for _, delta in gen.deltas():
                builder.add(parser.feed(delta.text))
            builder.add(parser.finish())
            _finish(builder, prepared, gen)
            return web.Response(body=encoder.encode(builder.response), content_type="application/json")
        finally:
            await gen.close()


def _finish(builder: ResponseBuilder, prepared: PreparedChat, gen: Generation) -> list[dict]:
    choice = gen.choices[0]
    num_prompt, num_completion, num_cached = gen.usage_counts()
    num_reasoning = 0
    if prepared.mode.in_reasoning is not None:
        tags = think_tokens(gen.engine.tokenizer)
        num_reasoning = tags.num_reasoning_tokens(choice.token_ids, prepared.mode.in_reasoning) if tags else 0
    usage = make_response_usage(num_prompt, num_completion, num_cached, num_reasoning)
    if choice.finish_reason == "length":
        return builder.finish("incomplete", usage, "max_output_tokens")
    return builder.finish("completed", usage)


async def _stream(request: web.Request, prepared: PreparedChat, gen: Generation,
                  builder: ResponseBuilder) -> web.StreamResponse:
    sse = SSEWriter(request)
    parser = ChatOutputParser(prepared.mode)

    def send(events: list[dict]) -> None:
        for event in events:
            sse.add(encoder.encode(event), event=event["type"])

    try:
        await sse.start()
        send(builder.start())
        await sse.flush()
        async for _, delta in gen.deltas():
            send(builder.add(parser.feed(delta.text)))
            if not gen.has_ready:
                await sse.flush()
        send(builder.add(parser.finish()))
        send(_finish(builder, prepared, gen))
        await sse.end()
    except ClientGone:
        log.debug("client left while streaming %s; aborting", builder.response.id)
    except GatewayError as err:  # the engine failed mid-stream: an in-band error event
        await sse.fail(error_payload(err), done=False)
    except Exception:
        log.exception("error while streaming %s", builder.response.id)
        await sse.fail(error_payload(GatewayError("internal error while streaming", status=500, code="internal_error")),
                       done=False)
    return sse.response
