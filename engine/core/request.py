"""One request's state inside the engine core (scheduler + sampler + output processing).

Positions are absolute: the request's known tokens are ``all_token_ids`` (prompt + accepted
outputs), of which ``[0, num_computed_tokens)`` have their KV written by scheduled steps::

    all_token_ids:  p0 p1 ... p(P-1) o0 o1 ... o(k-1)      (+ placeholders: tokens being sampled
                    |---- computed ----|---- to compute --|   by a step in flight, ids unknown yet)

``num_computed_tokens`` advances when a step is *scheduled* (so the next step can be scheduled
before this one finishes) and rolls back when speculative tokens are rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Literal

from deepinfer.cache.block_hash import BlockHash, MultiModalSpan, extend_block_hashes
from deepinfer.engine.api.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.mm.inputs import MultiModalInput
    from deepinfer.engine.sample.metadata import RowSpec


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after its blocks and slot were taken back (recompute)
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    seq_id: int  # integer id the runner sees (SeqStep.seq_id)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved at arrival: the user's seed or a random one
    arrival_index: int  # global FIFO order, kept across preemptions
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    mm_spans: Sequence[MultiModalSpan] = ()
    # the prompt's images (engine/mm/inputs.py): their spans salt the block hashes (mm_spans),
    # their embeddings replace the token embeddings when a step computes those positions
    mm_inputs: Sequence[MultiModalInput] = ()
    block_root: BlockHash = b""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Sampling steps scheduled but not yet committed (async scheduling: at most 1).
    num_output_placeholders: int = 0
    # Draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    # A step with draft tokens is in flight: how many it accepts is unknown, so nothing more
    # is scheduled for this request until that step is committed.
    is_awaiting_verification: bool = False

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0  # block_ids[:n] are in the prefix cache
    slot: int | None = None
    window_start: int = 0  # SeqStep.window_start: first replayed position after a prefix hit
    write_from: int = 0  # SeqStep.write_from: the prefix-hit length
    num_cached_tokens: int = -1  # prefix-hit length at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    scheduled_in: int = -1  # the scheduler's step counter when last scheduled
    num_prompt_logprob_rows_done: int = 0  # rows j (predicting prompt token j+1) already emitted

    # sampling constants of a plain request, filled on first use by the sampling preparer
    # (None: not computed yet, False: not plain); params must not change after arrival
    row_spec: RowSpec | Literal[False] | None = None

    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    # ---- sizes ------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens (prompt + accepted outputs)."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, FIFO within a priority."""
        return (self.sampling_params.priority, self.arrival_index)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def has_reached_length_limit(self) -> bool:
        """True once the outputs already decided (incl. in flight) reach max_tokens/max_model_len."""
        max_tokens = self.sampling_params.max_tokens
        num_out = self.num_output_tokens + self.num_output_placeholders
        if max_tokens is not None and num_out >= max_tokens:
            return True
        return self.num_tokens_with_placeholders >= self.max_model_len

    def append_output_tokens(self, token_ids: Sequence[int], block_size: int) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.block_root and len(self.all_token_ids) // block_size > len(self.block_hashes):
            extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.block_root, self.mm_spans)


@dataclass(frozen=True, slots=True)
class TokenStop:
    """How many of the new tokens to keep and why the request stops (if it does)."""

    num_kept: int
    status: RequestStatus | None = None
    stop_reason: int | str | None = None


def check_token_stop(request: Request, new_token_ids: Sequence[int]) -> TokenStop:
    """Token-level stop rules (text-level stop strings live in the output processor).

    EOS (unless ignore_eos) and stop_token_ids end the request with "stop"; reaching max_tokens
    or max_model_len ends it with "length". Before min_tokens outputs nothing stops it (the
    sampler also masks EOS/stop ids there). Tokens after the stopping one are dropped (they can
    exist when several speculative tokens are accepted at once).
    """
    params = request.sampling_params
    num_out = request.num_output_tokens
    num_total = request.num_tokens
    if not new_token_ids:
        return _KEEP[0]
    for i, tok in enumerate(new_token_ids):
        n = num_out + i + 1
        if n >= params.min_tokens:
            if not params.ignore_eos and tok in request.eos_token_ids:
                return TokenStop(i + 1, RequestStatus.FINISHED_STOPPED, None)
            if tok in params.stop_token_ids:
                return TokenStop(i + 1, RequestStatus.FINISHED_STOPPED, tok)
        if params.max_tokens is not None and n >= params.max_tokens:
            return TokenStop(i + 1, RequestStatus.FINISHED_LENGTH, None)
        if num_total + i + 1 >= request.max_model_len:
            return TokenStop(i + 1, RequestStatus.FINISHED_LENGTH, None)
    n = len(new_token_ids)
    return _KEEP[n] if n < len(_KEEP) else TokenStop(n)


_KEEP = tuple(TokenStop(n) for n in range(16))  # shared results of the common no-stop case
