"""What a caller (the HTTP gateway first) needs from an engine: the narrow ``EngineClient``
protocol, the values it returns (``ModelInfo``, ``EngineStats``) and the typed errors it raises.

The gateway never reaches into an engine. Anything with these members can be mounted: the
in-process ``AsyncEngine`` (embedded ``deepinfer serve``), a client of a disaggregated cluster,
or a test double. The gateway tokenizes, renders chat templates, checks the context length and
fans ``n > 1`` out into ``n`` engine requests of ``n == 1`` each (child seeds ``seed + i``), so an
engine only ever sees token-id prompts with ``params.n == 1``.

Contract of ``generate`` (an async generator, so nothing runs until the first ``__anext__``):

- it yields ``RequestOutput`` *deltas* (engine/api/outputs.py): each carries only the new token ids,
  new text and new logprob positions of ``outputs[0]``; the last one has ``finished=True`` and a
  ``finish_reason`` ("stop" | "length" | "abort") and then the generator ends;
- bad input surfaces as an exception from the first ``__anext__``, before any output:
  ``InvalidPromptError`` for a prompt the engine refuses (ids outside the vocabulary, empty, too
  long; -> HTTP 400 naming the prompt field), ``SamplingParamsError`` / ``StructuredOutputError``
  / any ``ValueError`` with a one-line message (-> HTTP 400/422), ``EngineOverloadedError`` when
  the waiting queue is full (-> HTTP 429). The engine checks these facts; the gateway does not
  check them again, it maps the errors (runtime/gateway/errors.py);
- ``abort(request_id)`` stops the request within one engine step and frees its state; aborting an
  unknown or already finished id is a no-op. The gateway calls it whenever a client goes away,
  possibly while a ``generate`` of that id is still being iterated (or was cancelled).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.sampling_params import SamplingParams


def one_line(exc: BaseException) -> str:
    """The first non-blank line of an exception's message (its type's name when it has none): how
    every error here reaches a client or a log line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


class InvalidPromptError(ValueError):
    """A prompt the engine cannot take (wrong shape, empty, too long, ids outside the vocabulary)."""


class EngineDeadError(RuntimeError):
    """The engine is shut down or failed too often to serve."""


class EngineStepError(RuntimeError):
    """A model step failed while this request was running; the request is finished."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""

    def __init__(self, message: str = "the server is at capacity; retry shortly", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt shape: the engine must use these ids as they are. With images,
    ``multi_modal_data`` = ``{"image": [...]}`` (engine/mm/prompt.py): one placeholder per image
    in the ids, or the ids already expanded to the images' spans."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the served model name (what ``model`` in a request must equal)
    max_model_len: int  # prompt + completion tokens a request may use
    vocab_size: int  # token ids in prompts must lie in [0, vocab_size)
    eos_token_ids: tuple[int, ...] = ()
    created: int = 0  # unix time shown by /v1/models


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics and admission control; cheap to take (no awaits, no locks)."""

    num_running: int = 0
    num_waiting: int = 0
    max_num_waiting: int | None = None  # queue capacity; None = unbounded
    prefix_cache_hit_rate: float | None = None  # hit tokens / queried prompt tokens, lifetime
    kv_cache_usage: float | None = None  # fraction of KV blocks in use
    swa_slots: Mapping[str, int] | None = None  # SWA slot counters (restored, replayed, fetched, ...), lifetime
    spec: Mapping[str, float] | None = None  # DSpark counters (drafted, verified, accepted, ...), lifetime
    ep: Mapping[str, float] | None = None  # expert parallelism: steps, re-placements, ... (ExpertParallel.stats)


@runtime_checkable
class GatewayTokenizer(Protocol):
    """The tokenizer calls the gateway makes (engine/text/tokenizer.py ``Tokenizer`` has them)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte fragment's are part of a UTF-8 character)."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render like transformers; raise ValueError (one line) when the conversation is refused.
        ``tokenize=True`` (what the gateway calls) must tokenize message text as text: a
        control-token string a user writes is never a control token."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> GatewayTokenizer | None:
        """None for an engine without a tokenizer: only token-id prompts are accepted then."""
        ...

    def generate(self, prompt: TokensPrompt, params: SamplingParams, *, request_id: str) -> AsyncIterator[RequestOutput]:
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def check_health(self) -> None:
        """Return if the engine can serve; raise (any exception, one-line message) if it cannot."""
        ...
