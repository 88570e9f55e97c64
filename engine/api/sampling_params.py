"""SamplingParams with vLLM's field names and meanings; validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

_TRAFFIC_CLASS = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # {"json": schema (dict or str)} | {"regex": str} | {"grammar": ebnf str} | {"json_object": True}
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0  # lower runs first among equals (FIFO within a priority)
    extra: dict[str, Any] = field(default_factory=dict)
    # the KV store's TTL class of the blocks this request writes ("agent", "chat", ...; "" = the
    # engine's default); set per request by the gateway, it travels with the request to every engine
    traffic_class: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (or -1 for disabled), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 20):
                bad(name, f"must be an integer in [0, 20], got {v!r}")
        if not isinstance(self.traffic_class, str) or (
                self.traffic_class and not _TRAFFIC_CLASS.fullmatch(self.traffic_class)):
            bad("traffic_class", f"must be a class name like 'chat' or 'agent' (a-z, 0-9, _ or -, up to 32), "
                                 f"got {self.traffic_class!r}")
        so = self.structured_outputs
        if so is not None:
            kinds = {"json", "regex", "grammar", "json_object"}
            if not isinstance(so, dict) or len(so) != 1 or next(iter(so)) not in kinds:
                bad("structured_outputs", f"must be a dict with exactly one of {sorted(kinds)}")


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The ``n == 1`` params of choice ``index`` of a request with ``n`` choices: the seed is
    ``seed + index`` (None stays None). The one fan-out rule, used by the engine (``n > 1``
    requests) and by the gateway (which fans out itself to stream choices separately)."""
    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
