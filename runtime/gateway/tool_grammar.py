"""The grammar that makes a model call tools: ``tool_choice`` "required" or a named function.

The output is DeepSeek's own markup (engine/text/markup.py) with each call's arguments held to
its function's JSON schema by xgrammar, so even a random model answers with calls whose
arguments validate; the engine receives the grammar as EBNF text (``structured_outputs
{"grammar": ...}``), compiled and cached there like any other.

    [reasoning ... </think>]  <｜tool▁calls▁begin｜> call+ <｜tool▁calls▁end｜>        "required"
    call = <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{schema of NAME}<｜tool▁call▁end｜>     one call when
                                                                    parallel_tool_calls is false
    [reasoning ... </think>]  <｜tool▁calls▁begin｜> call of F <｜tool▁calls▁end｜>      named F

When the prompt opened a ``<think>`` block, free reasoning text comes first and ``</think>``
closes it. A string value may spell a marker (xgrammar drops length limits from strings that
exclude text); the parser only ends a call at a marker outside JSON strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    JSONSchemaFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
)

from deepinfer.engine.api.protocol import one_line
from deepinfer.engine.sample.structured_output import json_string_chars_fixed
from deepinfer.engine.text.markup import (
    END_THINK,
    THINK,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)


class ToolGrammarError(ValueError):
    """A function's parameters are not a JSON schema xgrammar can compile; says which function."""


# Whitespace allowed between JSON tokens of the arguments: DeepSeek writes them on one line
# (``{"city": "Paris"}``); a weak model could otherwise spend its budget on blanks.
MAX_ARGUMENTS_WHITESPACE = 2


def _call_tag(name: str, schema: dict[str, Any]) -> TagFormat:
    return TagFormat(
        begin=f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}",
        content=JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_ARGUMENTS_WHITESPACE),
        end=TOOL_CALL_END,
    )


def tool_call_grammar(
    parameters: Mapping[str, dict[str, Any]],
    *,
    forced: str | None,
    parallel_tool_calls: bool,
    in_reasoning: bool,
) -> str:
    """EBNF for one or more calls of the functions in ``parameters`` (name -> arguments schema),
    or exactly one call of ``forced``; ``in_reasoning``: the prompt ends inside ``<think>``."""
    names = [forced] if forced is not None else list(parameters)
    tags = [_call_tag(name, parameters[name]) for name in names]
    calls = TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                    stop_after_first=forced is not None or not parallel_tool_calls)
    body = TagFormat(begin=TOOL_CALLS_BEGIN, content=calls, end=TOOL_CALLS_END)
    if in_reasoning:
        thought = TagFormat(begin="", content=AnyTextFormat(excludes=[THINK, END_THINK]), end=END_THINK)
        body = SequenceFormat(elements=[thought, body])
    try:
        grammar = xgr.Grammar.from_structural_tag(StructuralTag(format=body))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ToolGrammarError(_which_function(parameters, names, exc)) from None
    # the same JSON-string repair the engine applies to its own JSON-schema grammars
    return json_string_chars_fixed(grammar)


def _which_function(parameters: Mapping[str, dict[str, Any]], names: list[str], exc: Exception) -> str:
    for name in names:  # compile each alone to name the culprit
        try:
            xgr.Grammar.from_json_schema(json.dumps(parameters[name]))
        except (RuntimeError, ValueError, TypeError) as one:
            return f"the parameters of function {name!r} are not a usable JSON schema: {one_line(one)[:300]}"
    return f"the tool-call grammar could not be built: {one_line(exc)[:300]}"
