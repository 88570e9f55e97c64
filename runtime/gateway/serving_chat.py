"""``POST /v1/chat/completions``: messages (and tools) through the model's chat template; the
assistant's text out, read as reasoning, content and tool calls (chat_output.py)."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from deepinfer.runtime.gateway.chat_output import ChatOutputMode, ChatOutputParser, ChatPieces, parse_message
from deepinfer.runtime.gateway.chat_request import prepare_chat
from deepinfer.runtime.gateway.config import STATE_KEY, GatewayState
from deepinfer.runtime.gateway.errors import GatewayError, bad_request, error_payload
from deepinfer.runtime.gateway.generation import Generation
from deepinfer.runtime.gateway.openai_protocol import ChatCompletionRequest
from deepinfer.runtime.gateway.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    chat_logprobs,
    encoder,
    make_usage,
)
from deepinfer.runtime.gateway.response_wire import ClientGone, SSEWriter
from deepinfer.runtime.gateway.response_wire import request_id as client_request_id
from deepinfer.runtime.gateway.serving_common import (
    admitted,
    decode_body,
    engine_requests,
    is_silent_delta,
    new_request_id,
    served_model,
    token_byte_namer,
    token_namer,
)

log = logging.getLogger(__name__)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    req: ChatCompletionRequest = await decode_body(request, ChatCompletionRequest)
    model = served_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    prepared = await prepare_chat(state, req)
    request_id = new_request_id("chatcmpl")
    requests, structured = engine_requests(state, prepared.request, request_id, [prepared.prompt_token_ids],
                                           logprobs=num_top, default_max_tokens=None, prompt_param="messages",
                                           client_request_id=client_request_id(request))
    for r in requests:
        r.multi_modal_data = prepared.multi_modal_data
    async with admitted(state):
        gen = Generation(state.engine, requests, state.metrics, arrival_time=arrival,
                         structured_param=structured.param if structured else None, prompt_param="messages")
        try:
            await gen.start()
            if req.stream:
                return await _stream(request, state, req, gen, request_id, model, num_top, prepared.mode)
            return await _full(state, gen, request_id, model, num_top, prepared.mode)
        finally:
            await gen.close()


async def _full(state: GatewayState, gen: Generation, request_id: str, model: str,
                num_top: int | None, mode: ChatOutputMode) -> web.Response:
    async for _ in gen.deltas():
        pass
    token_text = token_namer(state.engine.tokenizer)
    token_bytes = token_byte_namer(state.engine.tokenizer)
    choices = []
    for c in gen.choices:
        logprobs = None
        if num_top is not None:
            logprobs = ChatLogprobs(chat_logprobs(c.token_ids, c.logprobs, num_top, token_text, token_bytes))
        message, num_calls = parse_message(mode, c.text)
        choices.append(ChatChoice(c.index, message, logprobs, mode.finish_reason(c.finish_reason, num_calls),
                                  c.stop_reason))
    resp = ChatCompletionResponse(request_id, int(time.time()), model, choices, make_usage(*gen.usage_counts()))
    return web.Response(body=encoder.encode(resp), content_type="application/json")


async def _stream(request: web.Request, state: GatewayState, req: ChatCompletionRequest, gen: Generation,
                  request_id: str, model: str, num_top: int | None, mode: ChatOutputMode) -> web.StreamResponse:
    sse = SSEWriter(request)
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    created = int(time.time())
    token_text = token_namer(state.engine.tokenizer)
    token_bytes = token_byte_namer(state.engine.tokenizer)
    parsers = {c.index: ChatOutputParser(mode) for c in gen.choices}

    def chunk(choices: list[ChatChunkChoice]) -> bytes:
        c = ChatCompletionChunk(request_id, created, model, choices)
        if include_usage:
            c.usage = make_usage(*gen.usage_counts()) if continuous else None
        return encoder.encode(c)

    try:
        await sse.start()
        # OpenAI opens every choice with a role-only delta
        for c in gen.choices:
            sse.add(chunk([ChatChunkChoice(c.index, ChatDelta(role="assistant", content=""))]))
        await sse.flush()
        async for choice, delta in gen.deltas():
            parser = parsers[choice.index]
            pieces = parser.feed(delta.text) if delta.text else ChatPieces()
            finish_reason = delta.finish_reason
            if finish_reason is not None:  # the text has ended: what the parsers held back comes out
                tail = parser.finish()
                pieces = ChatPieces(pieces.reasoning + tail.reasoning, pieces.content + tail.content,
                                    pieces.tool_calls + tail.tool_calls)
                finish_reason = mode.finish_reason(finish_reason, len(parser.calls))
            body = pieces.delta()
            num_logprob_tokens = len(delta.token_ids) if num_top is not None else 0
            if body is None and is_silent_delta("", finish_reason, num_logprob_tokens):
                continue
            logprobs = None
            if num_top is not None:
                logprobs = ChatLogprobs(chat_logprobs(delta.token_ids, delta.logprobs or [], num_top, token_text,
                                                      token_bytes))
            sse.add(chunk([ChatChunkChoice(choice.index, body or ChatDelta(), logprobs, finish_reason,
                                           delta.stop_reason)]))
            if not gen.has_ready:
                await sse.flush()
        if include_usage:
            final = ChatCompletionChunk(request_id, created, model, [], make_usage(*gen.usage_counts()))
            await sse.send(encoder.encode(final))
        await sse.done()
    except ClientGone:
        log.debug("client left while streaming %s; aborting", request_id)
    except GatewayError as err:  # the engine failed mid-stream: tell the client in-band
        await sse.fail(error_payload(err))
    except Exception:
        log.exception("error while streaming %s", request_id)
        await sse.fail(error_payload(GatewayError("internal error while streaming", status=500, code="internal_error")))
    return sse.response
