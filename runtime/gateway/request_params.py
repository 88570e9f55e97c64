"""From a decoded request to engine ``SamplingParams``: pure functions, one error per bad field.

Structured output arrives in four spellings and becomes one ``structured_outputs`` dict:

    response_format {"type": "json_object"}                -> {"json_object": True}
    response_format {"type": "json_schema", "json_schema": {"schema": S}}  -> {"json": S}
    structured_outputs {"json"|"regex"|"grammar"|"json_object"|"choice": v}
    guided_json / guided_regex / guided_grammar / guided_choice (older vLLM)

``choice`` (a list of strings) becomes an EBNF grammar that accepts exactly those strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.api.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.runtime.gateway.errors import GatewayError, bad_request
from deepinfer.runtime.gateway.openai_protocol import (
    ChatCompletionRequest,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingRequest,
)

MAX_SCHEMA_DEPTH = 64  # deeper schemas are hostile, not useful; the grammar compiler recurses


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    spec: dict[str, Any]  # what SamplingParams.structured_outputs receives
    param: str  # the request field it came from (named in errors)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counting stops once past ``limit`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _choice_grammar(choices: list[str], param: str) -> dict[str, Any]:
    if not choices:
        raise bad_request(f"{param} must list at least one string", param)
    if any(not c for c in choices):
        raise bad_request(f"{param} must not contain an empty string", param)
    # json.dumps writes the escapes EBNF string literals use (\" \\ \n \uXXXX)
    return {"grammar": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)}


def _from_fields(kinds: dict[str, Any], prefix: str) -> StructuredSpec | None:
    given = {k: v for k, v in kinds.items() if v is not None and v is not False}
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"{prefix}{k}" for k in given)
        raise bad_request(f"give only one of {names}", f"{prefix}{next(iter(given))}")
    kind, value = next(iter(given.items()))
    param = f"{prefix}{kind}"
    if kind == "choice":
        return StructuredSpec(_choice_grammar(value, param), param)
    if kind == "json_object":
        return StructuredSpec({"json_object": True}, param)
    if kind in ("regex", "grammar") and not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return StructuredSpec({kind: value}, param)


def structured_spec(req: SamplingRequest) -> StructuredSpec | None:
    """The one structured-output constraint of a request, or None; 400 if several are given."""
    specs: list[StructuredSpec] = []
    rf = req.response_format
    if isinstance(rf, ResponseFormatJsonObject):
        specs.append(StructuredSpec({"json_object": True}, "response_format"))
    elif isinstance(rf, ResponseFormatJsonSchema):
        schema = rf.json_schema.schema
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        specs.append(StructuredSpec({"json": schema}, "response_format"))
    so = req.structured_outputs
    if so is not None:
        spec = _from_fields(
            {"json": so.json, "regex": so.regex, "grammar": so.grammar, "choice": so.choice, "json_object": so.json_object},
            "structured_outputs.",
        )
        if spec is None:
            raise bad_request("structured_outputs must set one of json, regex, grammar, choice, json_object",
                              "structured_outputs")
        specs.append(spec)
    guided = _from_fields(
        {"json": req.guided_json, "regex": req.guided_regex, "grammar": req.guided_grammar, "choice": req.guided_choice},
        "guided_",
    )
    if guided is not None:
        specs.append(guided)
    if len(specs) > 1:
        raise bad_request(f"give only one structured-output constraint, got {specs[0].param} and {specs[1].param}",
                          specs[1].param)
    if not specs:
        return None
    spec = specs[0]
    value = next(iter(spec.spec.values()))
    if isinstance(value, str) and "json" in spec.spec:
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise GatewayError(f"{spec.param}: the JSON schema is not valid JSON", status=422, param=spec.param,
                               code="invalid_structured_output") from None
        if not isinstance(value, dict):
            raise GatewayError(f"{spec.param}: the JSON schema must be a JSON object", status=422, param=spec.param,
                               code="invalid_structured_output")
        spec = StructuredSpec({"json": value}, spec.param)
    if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{spec.param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", spec.param)
    return spec


def stop_strings(req: SamplingRequest, max_stop: int) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop:
        raise bad_request(f"stop allows at most {max_stop} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", "stop")
    return stop


def requested_max_tokens(req: SamplingRequest) -> tuple[int | None, str]:
    """(limit or None, the field it came from); chat prefers max_completion_tokens."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def sampling_params(
    req: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredSpec | None,
    stop: list[str],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Engine parameters of one completion (``n`` is 1: the gateway fans choices out itself)."""
    try:
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=None if structured is None else structured.spec,
            priority=req.priority,
            traffic_class=req.traffic_class or "",
        )
    except SamplingParamsError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field) from None
