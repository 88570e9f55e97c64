"""Structured output with xgrammar: regex, JSON schema, EBNF grammar, any JSON object.

A grammar is compiled once per distinct (kind, text) and kept in an LRU cache; ``compile`` is
thread-safe so callers (the gateway, AsyncEngine) run it in an executor, off the event loop and
off the engine step. Each request gets its own matcher (``GrammarState``): it fills the request's
row of the allowed-token bitmask before sampling, advances on accepted tokens, rolls back on
rejected speculative tokens and reports termination (-> the request finishes with "stop").
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from deepinfer.engine.api.protocol import one_line

KINDS = ("json", "regex", "grammar", "json_object")
# Longest run of whitespace a JSON schema grammar allows between tokens (any_whitespace mode):
# room for pretty-printed JSON nested 7 deep at indent 4, while a weak model can no longer fill
# its whole token budget with blanks.
MAX_JSON_WHITESPACE = 32
_VOCAB_TYPES = {"raw": xgr.VocabType.RAW, "byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK}


class StructuredOutputError(ValueError):
    """An invalid regex / JSON schema / EBNF grammar; the message says which and why, in one line."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str
    text: str  # canonical: a JSON schema is re-serialised with sorted keys

    @classmethod
    def from_params(cls, structured_outputs: Mapping[str, Any]) -> GrammarSpec:
        if not isinstance(structured_outputs, Mapping) or len(structured_outputs) != 1:
            raise StructuredOutputError(f"structured_outputs must have exactly one of {list(KINDS)}")
        kind, value = next(iter(structured_outputs.items()))
        if kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {kind!r}; use one of {list(KINDS)}")
        if kind == "json_object":
            return cls(kind, "")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise StructuredOutputError(f"invalid JSON schema: not valid JSON ({e.msg} at char {e.pos})") from None
            if not isinstance(value, (dict, bool)):
                raise StructuredOutputError("invalid JSON schema: it must be a JSON object")
            return cls(kind, json.dumps(value, sort_keys=True))
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(f"{kind} must be a non-empty string")
        return cls(kind, value)


class StructuredOutputBackend:
    """Compiles grammars against one tokenizer vocabulary and hands out matchers."""

    def __init__(
        self,
        vocab: Sequence[str | bytes],
        eos_token_ids: Sequence[int],
        *,
        vocab_size: int | None = None,
        vocab_type: str = "raw",
        add_prefix_space: bool = False,
        any_whitespace: bool = True,
        cache_size: int = 256,
        max_threads: int = 2,
    ) -> None:
        if vocab_type not in _VOCAB_TYPES:
            raise ValueError(f"vocab_type must be one of {sorted(_VOCAB_TYPES)}, got {vocab_type!r}")
        info = xgr.TokenizerInfo(
            list(vocab),
            _VOCAB_TYPES[vocab_type],
            vocab_size=vocab_size or len(vocab),
            stop_token_ids=list(eos_token_ids),
            add_prefix_space=add_prefix_space,
        )
        self._init(info, any_whitespace, cache_size, max_threads)

    @classmethod
    def from_hf_tokenizer(
        cls, tokenizer: Any, eos_token_ids: Sequence[int], *, vocab_size: int | None = None, **kw: Any
    ) -> StructuredOutputBackend:
        """From a transformers tokenizer, or a ``tokenizers.Tokenizer`` (wrapped on the fly)."""
        if not hasattr(tokenizer, "get_vocab") or not hasattr(tokenizer, "backend_tokenizer"):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self = cls.__new__(cls)
        self._init(info, kw.get("any_whitespace", True), kw.get("cache_size", 256), kw.get("max_threads", 2))
        return self

    def _init(self, info: xgr.TokenizerInfo, any_whitespace: bool, cache_size: int, max_threads: int) -> None:
        self.tokenizer_info = info
        self.vocab_size = info.vocab_size
        self.any_whitespace = any_whitespace
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiles = 0

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, spec: GrammarSpec | Mapping[str, Any]) -> xgr.CompiledGrammar:
        """Compiled grammar for ``spec`` (LRU-cached; safe to call from any thread)."""
        if not isinstance(spec, GrammarSpec):
            spec = GrammarSpec.from_params(spec)
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile_uncached(spec)
        with self._lock:
            self.num_compiles += 1
            # a thread that lost a compile race returns the winner: one object per spec
            compiled = self._cache.setdefault(spec, compiled)
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json":
                grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=self.any_whitespace,
                                                       max_whitespace_cnt=MAX_JSON_WHITESPACE if self.any_whitespace else None)
                return self._compiler.compile_grammar(json_string_chars_fixed(grammar))
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.text)
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.text)
            return self._compiler.compile_builtin_json_grammar()
        except (RuntimeError, ValueError, TypeError) as e:
            raise StructuredOutputError(f"invalid {_KIND_NAMES[spec.kind]}: {_one_line(e)}") from None

    def new_state(self, spec: GrammarSpec | Mapping[str, Any] | xgr.CompiledGrammar) -> GrammarState:
        compiled = spec if isinstance(spec, xgr.CompiledGrammar) else self.compile(spec)
        return GrammarState(compiled, self.vocab_size)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """``[num_rows, ceil(V/32)]`` int32, all tokens allowed (-1 = every bit set)."""
        return torch.full((num_rows, self.bitmask_width), -1, dtype=torch.int32)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over ``token_ids``; returns how many were accepted (stops at the first the
        grammar rejects, or once it has terminated)."""
        for i, tok in enumerate(token_ids):
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(tok)):
                return i
            self.num_accepted += 1
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {self.num_accepted} accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``; a terminated matcher allows all
        (its request is finishing; the row's sample is discarded)."""
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmasks_for_drafts(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int]) -> None:
        """Rows ``first_row + i`` get the mask after accepting ``draft_token_ids[:i]`` (speculative
        verification needs a mask per position); the matcher ends where it started."""
        num_advanced = 0
        for i in range(len(draft_token_ids) + 1):
            self.fill_bitmask(bitmask, first_row + i)
            if i == len(draft_token_ids):
                break
            if self.accept([draft_token_ids[i]]) != 1:
                for j in range(i + 1, len(draft_token_ids) + 1):
                    bitmask[first_row + j].fill_(-1)  # beyond an invalid draft: rows are rejected anyway
                break
            num_advanced += 1
        self.rollback(num_advanced)


# xgrammar 0.2.9 writes a JSON string with minLength / maxLength as ``X_characters{m, n}`` with
# ``X_characters ::= [^"\\\r\n]``: raw control characters (invalid JSON: the output would not parse)
# and no escapes. Each such rule becomes JSON's string character (one escape = one character).
_LENGTH_LIMITED_CHARS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_STRING_CHAR = (r'\1 ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" ([\\"\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] '
                     r'[A-Fa-f0-9] [A-Fa-f0-9])))')


def json_string_chars_fixed(grammar: xgr.Grammar) -> str:
    """``grammar``'s EBNF with every length-limited JSON string character rule made JSON-valid."""
    return _LENGTH_LIMITED_CHARS.sub(_JSON_STRING_CHAR, str(grammar))


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar", "json_object": "JSON grammar"}


def _one_line(e: Exception) -> str:
    """``one_line`` without xgrammar's log prefixes."""
    msg = one_line(e)
    msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)  # xgrammar's "[time] file.cc:NN: " prefix
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg
