"""Request schemas of the OpenAI-compatible API, as strict msgspec Structs.

Decoding a body with ``msgspec.json.decode(body, type=ChatCompletionRequest)`` checks every type
and range in one pass and names the JSON path of the first problem (``$.messages[0].role``);
errors.py turns that into an OpenAI-format 400. Integers are bounded so nothing downstream meets
an unbounded Python int; floats are finite by construction (JSON has no NaN/Infinity and msgspec
rejects out-of-range literals).

Every field OpenAI defines is declared with its type, also those this server does not use
(``store``, ``metadata``, ``service_tier``, ...), so a value of the wrong type is a 400 whether or
not it is used. Top-level fields nobody defines are ignored, as OpenAI does (``decode_request``
logs each such name once, at debug level). Fields that would change the result if silently
ignored are rejected with a clear message by ``unsupported_fields`` when set. Nested objects
(``stream_options``, ``response_format``, ``structured_outputs``) forbid unknown keys.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

log = logging.getLogger(__name__)

MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
TokenCount = Annotated[int, Meta(ge=1, le=MAX_INT32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]
# OpenAI's rule for function names (they appear verbatim in the tool-call markup)
FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.:-]{1,64}$")]


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
    # DeepInfer: the KV store's TTL class of this request's blocks ("agent", "chat"; None: the server's)
    traffic_class: Annotated[str, Meta(max_length=32)] | None = None
    # defined by OpenAI, typed, not used: a wrong type is still a 400
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # accepted only at their neutral values (see unsupported_fields)
    logit_bias: dict[str, float] | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_INT32)] | None = None


class CompletionRequest(SamplingRequest, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] | None = None  # 0: with echo, score the prompt only
    logprobs: NumLogprobs | None = None
    echo: bool = False  # the prompt first, in the text and (with logprobs) in the logprobs
    prompt_logprobs: NumLogprobs | None = None  # vLLM's extension: every prompt position's logprobs
    suffix: str | None = None


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(Struct, tag="image_url", tag_field="type"):
    image_url: Any = None


class InputAudioPart(Struct, tag="input_audio", tag_field="type"):
    input_audio: Any = None


class RefusalPart(Struct, tag="refusal", tag_field="type"):
    refusal: str


ContentPart = TextPart | ImageUrlPart | InputAudioPart | RefusalPart


class FunctionCall(Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class ToolCallRequest(Struct):
    """A call in an assistant message the client sends back."""

    function: FunctionCall
    id: str = ""
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallRequest] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant; not rendered (templates drop past reasoning)


class FunctionDefinition(Struct):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class ToolChoiceFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: ToolChoiceFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    continue_final_message: bool = False
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", [], {}, 0)


def unsupported_fields(req: SamplingRequest) -> tuple[str, str] | None:
    """(field, why) for the first field set to something this server cannot honour."""
    if _is_set(req.logit_bias):
        return "logit_bias", "logit_bias is not supported by this server"
    if req.best_of is not None and req.best_of != 1 and req.best_of != req.n:
        return "best_of", "best_of is not supported by this server; use n"
    if isinstance(req, CompletionRequest):
        if _is_set(req.suffix):
            return "suffix", "suffix is not supported by this server"
    if isinstance(req, ChatCompletionRequest):
        for name in ("continue_final_message", "audio", "prediction", "web_search_options"):
            if _is_set(getattr(req, name)):
                return name, f"{name} is not supported by this server"
        if _is_set(req.functions):
            return "functions", "functions (the legacy form) is not supported by this server; use tools"
        if req.function_call not in (None, "none", "auto"):
            return "function_call", "function_call (the legacy form) is not supported by this server; use tool_choice"
        if req.modalities is not None and req.modalities != ["text"]:
            return "modalities", "only the 'text' modality is supported"
    return None


_decoders: dict[type, msgspec.json.Decoder] = {}
_keys_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_MAX_LOGGED_UNKNOWN = 256
_logged_unknown: set[tuple[str, str]] = set()


def decode_request(body: bytes, kind: type[Struct]) -> Any:
    """Typed decode; raises msgspec.DecodeError / ValidationError (or RecursionError). A top-level
    field ``kind`` does not define is ignored; its name is logged once (debug)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    req = dec.decode(body)
    if log.isEnabledFor(logging.DEBUG):
        _log_unknown_fields(body, kind)
    return req


def _log_unknown_fields(body: bytes, kind: type[Struct]) -> None:
    known = kind.__struct_fields__
    for name in _keys_decoder.decode(body):
        key = (kind.__name__, name)
        if name not in known and key not in _logged_unknown and len(_logged_unknown) < _MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(key)
            log.debug("ignoring the field %r of %s, which this server does not know (logged once)", name[:64],
                      kind.__name__)
