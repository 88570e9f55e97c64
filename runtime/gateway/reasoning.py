"""Reasoning text split from the answer, for chat templates with DeepSeek's ``<think>`` blocks.

A thinking prompt ends inside an open ``<think>`` (the template wrote it), so the output starts
as reasoning and ``</think>`` switches to the answer; an output that itself opens with
``<think>`` does the same. Everything else is content. ``ReasoningParser`` splits one
choice's text as it streams, holding back a tail that might be the start of a tag:

    prompt ...<｜Assistant｜><think>   output: "let me see</think>The answer"
                                               ^^^^^^^^^^ reasoning  ^^^^^^^^^^ content

Whether a request thinks is the template's business (``chat_template_kwargs``, e.g.
``{"thinking": true}``); the gateway reads the answer off the rendered prompt's tokens
(``opens_reasoning``), so it holds for any template that spells the tags as single tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from deepinfer.engine.api.protocol import GatewayTokenizer
from deepinfer.engine.text.markup import END_THINK, THINK


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    think_id: int
    end_think_id: int

    def opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """The prompt leaves a ``<think>`` block open: generation starts inside it."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_think_id:
                return False
            if token_id == self.think_id:
                return True
        return False

    def num_reasoning_tokens(self, output_token_ids: Sequence[int], in_reasoning: bool) -> int:
        """Output tokens spent reasoning: up to and including the ``</think>`` that closes the
        block (the whole output if it never closes), when the output starts in or opens one."""
        if not output_token_ids:
            return 0
        if not in_reasoning and output_token_ids[0] != self.think_id:
            return 0
        try:
            return output_token_ids.index(self.end_think_id) + 1
        except ValueError:
            return len(output_token_ids)


@lru_cache(maxsize=8)
def think_tokens(tokenizer: GatewayTokenizer) -> ThinkTokens | None:
    """The think tags' token ids, or None if this tokenizer has no single-token tags (its
    templates do not think, and its outputs are all content)."""
    think = tokenizer.encode(THINK, add_special_tokens=False)
    end = tokenizer.encode(END_THINK, add_special_tokens=False)
    if len(think) != 1 or len(end) != 1 or tokenizer.decode(end, skip_special_tokens=True) != END_THINK:
        return None  # not single tokens, or decoding drops them (then the text cannot be split)
    return ThinkTokens(think[0], end[0])


def _held_prefix(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_START, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits one choice's text into (reasoning, content) pieces; ``feed`` deltas, ``finish``."""

    def __init__(self, in_reasoning: bool):
        self._state = _REASONING if in_reasoning else _START
        self._buf = ""

    @property
    def is_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        if self._state == _START:
            stripped = buf.lstrip()
            if stripped.startswith(THINK):
                buf, self._state = stripped[len(THINK) :], _REASONING
            elif THINK.startswith(stripped):  # still might open a block (or nothing yet)
                self._buf = buf
                return "", ""
            else:
                self._state = _CONTENT
        if self._state == _CONTENT:
            return "", buf
        at = buf.find(END_THINK)
        if at >= 0:
            self._state = _CONTENT
            return buf[:at], buf[at + len(END_THINK) :]
        keep = _held_prefix(buf, END_THINK)
        self._buf = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == _REASONING:
            return rest, ""
        return "", rest
