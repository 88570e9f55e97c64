"""Request schemas of the OpenAI-compatible API, as strict msgspec Structs.

Decoding a body with ``msgspec.json.decode(body, type=ChatCompletionRequest)`` checks every type
and range in one pass and names the JSON path of the first problem (``$.messages[0].role``);
errors.py turns that into an OpenAI-format 400. Integers are bounded so nothing downstream meets
an unbounded Python int; floats are finite by construction (JSON has no NaN/Infinity and msgspec
rejects out-of-range literals).

Top-level fields this server does not know are ignored (clients send ``user``, ``store``,
``metadata``, ...); fields that would change the result if silently ignored are declared as
``Any`` here and rejected with a clear message by ``unsupported_fields`` when set. Nested
objects (``stream_options``, ``response_format``, ``structured_outputs``) forbid unknown keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
TokenCount = Annotated[int, Meta(ge=1, le=MAX_INT32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaSpec(Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormatText(Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class ResponseFormatJsonObject(Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    pass


class ResponseFormatJsonSchema(Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputsRequest(Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one of the fields."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class SamplingRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_INT32)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None  # older vLLM spellings of structured_outputs
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Meta(ge=-MAX_INT32, le=MAX_INT32)] = 0
    user: str | None = None
    # accepted only at their neutral values (see unsupported_fields)
    logit_bias: Any = None
    best_of: Any = None


class CompletionRequest(SamplingRequest, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: NumLogprobs | None = None
    echo: Any = None
    suffix: Any = None


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(Struct, tag="image_url", tag_field="type"):
    image_url: Any = None


class InputAudioPart(Struct, tag="input_audio", tag_field="type"):
    input_audio: Any = None


ContentPart = TextPart | ImageUrlPart | InputAudioPart


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    continue_final_message: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", [], {}, 0)


def unsupported_fields(req: SamplingRequest) -> tuple[str, str] | None:
    """(field, why) for the first field set to something this server cannot honour."""
    if _is_set(req.logit_bias):
        return "logit_bias", "logit_bias is not supported by this server"
    if req.best_of is not None and req.best_of != 1 and req.best_of != req.n:
        return "best_of", "best_of is not supported by this server; use n"
    if isinstance(req, CompletionRequest):
        if _is_set(req.echo):
            return "echo", "echo is not supported by this server"
        if _is_set(req.suffix):
            return "suffix", "suffix is not supported by this server"
    if isinstance(req, ChatCompletionRequest):
        for name in ("tools", "functions", "continue_final_message", "audio", "prediction"):
            if _is_set(getattr(req, name)):
                return name, f"{name} is not supported by this server"
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none", "auto"):
                return name, f"{name} is not supported by this server (tool calling is not implemented)"
        if req.modalities is not None and req.modalities != ["text"]:
            return "modalities", "only the 'text' modality is supported"
    return None


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_request(body: bytes, kind: type[Struct]) -> Any:
    """Typed decode; raises msgspec.DecodeError / ValidationError (or RecursionError)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    return dec.decode(body)
