"""``POST /v1/completions``: prompts in, text (or an SSE stream of text deltas) out.

``echo`` and prompt logprobs are laid out as OpenAI and vLLM lay them out. With ``echo`` the
prompt comes first: in the text, and (with ``logprobs``) in the logprobs, one entry per prompt
token before the generated ones. The first prompt token has nothing before it, so its logprob
and top logprobs are ``null``; offsets run on through the generated tokens:

    tokens          [p0,   p1,   ..., pK-1, g0,  g1 ...]
    token_logprobs  [null, lp1,  ..., lpK-1, lg0, ...]
    top_logprobs    [null, {..}, ..., {..},  {..}, ...]

``max_tokens: 0`` with ``echo`` scores the prompt only (what lm-eval's loglikelihood sends): the
engine samples one token (max_tokens 1, the least it runs), which is dropped; the choice
finishes with "length" and counts no completion tokens. ``prompt_logprobs: k`` (vLLM's
extension) adds every prompt position's logprobs keyed by token id, ``null`` first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from aiohttp import web
from msgspec import UNSET, UnsetType

from deepinfer.engine.api.outputs import PositionLogprobs
from deepinfer.runtime.gateway.config import STATE_KEY
from deepinfer.runtime.gateway.engine_inputs import completion_prompts, num_prompts
from deepinfer.runtime.gateway.errors import GatewayError, bad_request, error_payload
from deepinfer.runtime.gateway.generation import ChoiceState, Generation
from deepinfer.runtime.gateway.openai_protocol import CompletionRequest
from deepinfer.runtime.gateway.openai_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
    TokenText,
    Usage,
    best_logprobs,
    completion_logprobs,
    encoder,
    finite,
    make_usage,
)
from deepinfer.runtime.gateway.response_wire import ClientGone, SSEWriter
from deepinfer.runtime.gateway.response_wire import request_id as client_request_id
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

log = logging.getLogger(__name__)


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE_KEY]
    req: CompletionRequest = await decode_body(request, CompletionRequest)
    model = served_model(state, req.model)
    plan = EchoPlan.of(req)
    check_n(state, req.n, num_prompts(req.prompt))  # before tokenizing a batch that cannot be served
    prompts = await completion_prompts(req.prompt, state.engine.tokenizer)
    request_id = new_request_id("cmpl")
    engine_req = msgspec.structs.replace(req, max_tokens=1) if plan.score_only else req
    requests, structured = engine_requests(
        state, engine_req, request_id, prompts, logprobs=req.logprobs,
        default_max_tokens=state.config.default_completion_max_tokens, prompt_param="prompt",
        prompt_logprobs=plan.engine_prompt_logprobs, client_request_id=client_request_id(request))
    tok = state.engine.tokenizer
    echoes = echo_texts(req.prompt, prompts, tok.decode, req.skip_special_tokens) if plan.echo and tok else None
    if plan.echo and echoes is None:
        echoes = [""] * len(prompts)  # token ids without a tokenizer: nothing to show as text
    view = _View(req, plan, prompts, echoes, token_namer(tok))
    async with admitted(state):
        gen = Generation(state.engine, requests, state.metrics, arrival_time=arrival,
                         structured_param=structured.param if structured else None, prompt_param="prompt")
        try:
            await gen.start()
            if req.stream:
                return await _stream(request, req, gen, request_id, model, view)
            return await _full(gen, request_id, model, view)
        finally:
            await gen.close()


@dataclass(slots=True)
class _View:
    """How one request's choices are shown: echo, score-only, logprobs (the echo layout below)."""

    req: CompletionRequest
    plan: EchoPlan
    prompts: list[list[int]]
    echoes: list[str] | None
    token_text: TokenText

    def first(self, c: ChoiceState) -> tuple[str, CompletionLogprobs | None, int, list | UnsetType]:
        """What a choice shows before its generated tokens: (text, logprobs, text offset, prompt logprobs)."""
        req, ids = self.req, self.prompts[c.prompt_index]
        text, logprobs, offset = "", None, 0
        if self.plan.echo:
            text = self.echoes[c.prompt_index]
            if req.logprobs is not None:
                logprobs, offset = echo_logprobs(ids, c.prompt_logprobs, req.logprobs, self.token_text)
        prompt_lps: list | UnsetType = UNSET
        if req.prompt_logprobs is not None:
            prompt_lps = prompt_logprob_entries(ids, c.prompt_logprobs, req.prompt_logprobs, self.token_text)
        return text, logprobs, offset, prompt_lps

    def generated_logprobs(self, before: CompletionLogprobs | None, offset: int, token_ids, positions
                           ) -> tuple[CompletionLogprobs | None, int]:
        if self.req.logprobs is None:
            return None, offset
        if before is None:
            return completion_logprobs(token_ids, positions, self.req.logprobs, self.token_text, offset)
        merged = with_generated(before, offset, token_ids, positions, self.req.logprobs, self.token_text)
        end = merged.text_offset[-1] + len(merged.tokens[-1]) if merged.tokens else offset
        return merged, end

    def usage(self, gen: Generation) -> Usage:
        num_prompt, num_completion, num_cached = gen.usage_counts()
        return make_usage(num_prompt, 0 if self.plan.score_only else num_completion, num_cached)


async def _full(gen: Generation, request_id: str, model: str, view: _View) -> web.Response:
    async for _ in gen.deltas():
        pass
    choices = []
    for c in gen.choices:
        text, logprobs, offset, prompt_lps = view.first(c)
        if view.plan.score_only:
            choice = CompletionChoice(c.index, text, logprobs, "length")
        else:
            logprobs, _ = view.generated_logprobs(logprobs, offset, c.token_ids, c.logprobs)
            choice = CompletionChoice(c.index, text + c.text, logprobs, c.finish_reason, c.stop_reason)
        choice.prompt_logprobs = prompt_lps
        choices.append(choice)
    resp = CompletionResponse(request_id, int(time.time()), model, choices, view.usage(gen))
    return web.Response(body=encoder.encode(resp), content_type="application/json")


async def _stream(request: web.Request, req: CompletionRequest, gen: Generation, request_id: str, model: str,
                  view: _View) -> web.StreamResponse:
    sse = SSEWriter(request)
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    created = int(time.time())
    text_offsets = [0] * len(gen.choices)
    is_opened = [False] * len(gen.choices)

    def add(choice: CompletionChoice) -> None:
        chunk = CompletionResponse(request_id, created, model, [choice])
        if include_usage:
            chunk.usage = view.usage(gen) if continuous else None
        sse.add(encoder.encode(chunk))

    try:
        await sse.start()
        async for choice, delta in gen.deltas():
            i = choice.index
            if not is_opened[i]:  # the echo (and prompt logprobs) lead a choice's first chunk
                is_opened[i] = True
                text, before, text_offsets[i], prompt_lps = view.first(choice)
                if view.plan.score_only:
                    first = CompletionChoice(i, text, before, "length")
                    first.prompt_logprobs = prompt_lps
                    add(first)
                    continue
                if text or before is not None or prompt_lps is not UNSET:
                    first = CompletionChoice(i, text, before, None)
                    first.prompt_logprobs = prompt_lps
                    add(first)
            if view.plan.score_only:
                continue
            if is_silent_delta(delta.text, delta.finish_reason, len(delta.token_ids) if req.logprobs is not None else 0):
                continue
            logprobs, text_offsets[i] = view.generated_logprobs(None, text_offsets[i], delta.token_ids,
                                                                delta.logprobs or [])
            add(CompletionChoice(i, delta.text, logprobs, delta.finish_reason, delta.stop_reason))
            if not gen.has_ready:
                await sse.flush()
        if include_usage:
            await sse.send(encoder.encode(CompletionResponse(request_id, created, model, [], view.usage(gen))))
        await sse.done()
    except ClientGone:
        log.debug("client left while streaming %s; aborting", request_id)
    except GatewayError as err:  # the engine failed mid-stream: tell the client in-band
        await sse.fail(error_payload(err))
    except Exception:
        log.exception("error while streaming %s", request_id)
        await sse.fail(error_payload(GatewayError("internal error while streaming", status=500, code="internal_error")))
    return sse.response


# ---- echo and prompt logprobs ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EchoPlan:
    echo: bool
    score_only: bool  # max_tokens 0: the generated token is dropped
    engine_prompt_logprobs: int | None  # what the engine must compute per prompt position

    @classmethod
    def of(cls, req: CompletionRequest) -> EchoPlan:
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1; 0 (score the prompt only) needs echo=true",
                              "max_tokens")
        wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        return cls(req.echo, req.max_tokens == 0, max(wanted) if wanted else None)


def echo_texts(prompt: str | list, prompts: Sequence[Sequence[int]], decode, skip_special_tokens: bool) -> list[str]:
    """The text each prompt echoes: as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in prompts]


def _need(positions: list[PositionLogprobs | None] | None, num_prompt_tokens: int) -> list[PositionLogprobs | None]:
    if positions is None or len(positions) != num_prompt_tokens:
        raise GatewayError("the engine did not return the prompt's logprobs", status=503, code="engine_error")
    return positions


def echo_logprobs(prompt_ids: Sequence[int], positions: list[PositionLogprobs | None] | None, num_top: int,
                  token_text: TokenText) -> tuple[CompletionLogprobs, int]:
    """The prompt's part of the logprobs, and the text offset after it."""
    positions = _need(positions, len(prompt_ids))
    lp = CompletionLogprobs([], [], [], [])
    offset = 0
    for tid, pos in zip(prompt_ids, positions):
        chosen = pos.get(tid) if pos is not None else None
        text = token_text(tid, chosen.decoded_token if chosen is not None else None)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
        if pos is None or chosen is None:  # the first position: nothing came before it
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        top = {token_text(t, pos[t].decoded_token): finite(v) for t, v in best_logprobs(pos, num_top)}
        top.setdefault(text, finite(chosen.logprob))  # the prompt's own token is always listed
        lp.token_logprobs.append(finite(chosen.logprob))
        lp.top_logprobs.append(top)
    return lp, offset


def with_generated(prompt_part: CompletionLogprobs, offset: int, token_ids: Sequence[int],
                   positions: Sequence[PositionLogprobs], num_top: int, token_text: TokenText) -> CompletionLogprobs:
    generated, _ = completion_logprobs(token_ids, positions, num_top, token_text, offset)
    return CompletionLogprobs(prompt_part.tokens + generated.tokens,
                              prompt_part.token_logprobs + generated.token_logprobs,
                              prompt_part.top_logprobs + generated.top_logprobs,
                              prompt_part.text_offset + generated.text_offset)


def prompt_logprob_entries(prompt_ids: Sequence[int], positions: list[PositionLogprobs | None] | None, num_top: int,
                           token_text: TokenText) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per position the prompt's token and the ``num_top`` most likely."""
    positions = _need(positions, len(prompt_ids))
    out: list[dict[int, PromptLogprob] | None] = []
    for tid, pos in zip(prompt_ids, positions):
        if pos is None:
            out.append(None)
            continue
        keep = {t for t, _ in best_logprobs(pos, num_top)} | {tid}
        out.append({t: PromptLogprob(finite(pos[t].logprob), pos[t].rank, token_text(t, pos[t].decoded_token))
                    for t in pos if t in keep})
    return out
