"""``echo`` and prompt logprobs on ``/v1/completions``, laid out as OpenAI and vLLM lay them out.

With ``echo`` the prompt comes first: in the text, and (with ``logprobs``) in the logprobs, one
entry per prompt token before the generated ones. The first prompt token has nothing before it,
so its logprob and top logprobs are ``null``; offsets run on through the generated tokens:

    tokens          [p0,   p1,   ..., pK-1, g0,  g1 ...]
    token_logprobs  [null, lp1,  ..., lpK-1, lg0, ...]
    top_logprobs    [null, {..}, ..., {..},  {..}, ...]

``max_tokens: 0`` with ``echo`` scores the prompt only (what lm-eval's loglikelihood sends): the
engine samples one token (max_tokens 1, the least it runs), which is dropped; the choice
finishes with "length" and counts no completion tokens. ``prompt_logprobs: k`` (vLLM's
extension) adds every prompt position's logprobs keyed by token id, ``null`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.engine.api.outputs import PositionLogprobs
from deepinfer.runtime.gateway.errors import GatewayError, bad_request
from deepinfer.runtime.gateway.openai_protocol import CompletionRequest
from deepinfer.runtime.gateway.openai_responses import (
    CompletionLogprobs,
    PromptLogprob,
    TokenText,
    best_logprobs,
    completion_logprobs,
    finite,
)


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
