"""Response shapes of the OpenAI-compatible API (msgspec Structs) and the logprob formats.

``None`` fields encode as ``null`` (OpenAI clients expect ``"finish_reason": null`` and
``"logprobs": null``); fields left ``UNSET`` are omitted, which is how a chunk leaves out
``usage`` unless ``stream_options.include_usage`` asked for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec
from msgspec import UNSET, Struct, UnsetType

from deepinfer.engine.api.outputs import PositionLogprobs

# JSON has no -inf; a token the grammar masked out gets vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(num_prompt: int, num_completion: int, num_cached: int) -> Usage:
    return Usage(num_prompt, num_completion, num_prompt + num_completion, PromptTokensDetails(num_cached))


# ---- /v1/completions ----------------------------------------------------------------------
class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's ``prompt_logprobs`` entry: one token of one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # vLLM's extension, keyed by token id; the first position has no logprobs (None)
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


# ---- /v1/chat/completions -----------------------------------------------------------------
class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None | UnsetType = UNSET  # only from templates that think
    tool_calls: list[ToolCallOut] | UnsetType = UNSET  # only when the model called tools


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "chat.completion"


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(Struct, omit_defaults=True):
    """A call's first delta carries its id, type and name; later ones pieces of its arguments."""

    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatDelta(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "chat.completion.chunk"


# ---- /v1/models ---------------------------------------------------------------------------
class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "deepinfer"
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


encoder = msgspec.json.Encoder()


# ---- logprobs -----------------------------------------------------------------------------
TokenText = Callable[[int, str | None], str]  # (token id, engine's decoded text or None) -> text
# (token id, its text) -> the token's raw bytes; a byte fragment's text is only U+FFFD, so its
# bytes must come from the tokenizer (serving_common.token_byte_namer), never from the text
TokenBytes = Callable[[int, str], list[int]]


def text_bytes(token_id: int, text: str) -> list[int]:
    """Bytes from the token's text: right for whole characters only (no tokenizer at hand)."""
    return list(text.encode("utf-8", "replace"))


def finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def best_logprobs(position: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely (token id, logprob) of a position, best first."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
    return [(tid, lp.logprob) for tid, lp in ranked[:num_top]]


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int, token_text: TokenText,
    token_bytes: TokenBytes = text_bytes,
) -> list[ChatTokenLogprob]:
    out = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        if chosen is None:  # an engine that left the sampled token out: nothing truthful to say
            continue
        text = token_text(tid, chosen.decoded_token)
        tops = []
        for top_id, top_lp in best_logprobs(pos, num_top):
            top_text = token_text(top_id, pos[top_id].decoded_token)
            tops.append(TopLogprob(top_text, finite(top_lp), token_bytes(top_id, top_text)))
        out.append(ChatTokenLogprob(text, finite(chosen.logprob), token_bytes(tid, text), tops))
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top: int,
    token_text: TokenText,
    text_offset: int,
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format for these tokens; also returns the offset after them."""
    lp = CompletionLogprobs([], [], [], [])
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        if chosen is None:
            continue
        text = token_text(tid, chosen.decoded_token)
        top = {token_text(t, pos[t].decoded_token): finite(v) for t, v in best_logprobs(pos, num_top)}
        top.setdefault(text, finite(chosen.logprob))  # the sampled token is always listed, as in vLLM
        lp.tokens.append(text)
        lp.token_logprobs.append(finite(chosen.logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(text_offset)
        text_offset += len(text)
    return lp, text_offset
