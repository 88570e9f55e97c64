"""The scheduler's data: config, one step's plan and budget, commit results, the waiting queue.

- ``StepBudget``: one ``schedule()`` call's budget: the tokens it has left, the cost features of
  what it has scheduled so far (``StepFeatures``), and prefill chunk sizing against the fitted cost
  model (ARCHITECTURE.md, "Balancers": inside one GPU the chunk of a prefill step is not fixed; the
  cost model predicts step time from the chunk's token count and its already-computed prefix, and
  the scheduler takes the largest chunk that still fits the step-time target within the token budget).
- ``WaitingQueue``: lowest (priority, arrival) first, with O(log n) push/pop and lazy removal;
  preempted requests keep their original arrival index, so they go back ahead of everything that
  arrived after them (fair FIFO within a priority).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from deepinfer.engine.api.protocol import InvalidPromptError
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from deepinfer.engine.sched.cost_model import CostModel

# Token id of a position whose token is being sampled by the step in flight (async scheduling);
# the engine writes the real id into SeqStep.token_ids before the step runs.
PLACEHOLDER_TOKEN_ID = -1


class SchedulerError(InvalidPromptError):
    """A request the scheduler cannot take (empty or too long prompt, duplicate id)."""


@dataclass(slots=True)
class StepFeatures:
    """Running sums over the sequences of one step (mutable accumulator)."""

    num_seqs: int = 0
    sum_n: float = 0.0
    sum_np: float = 0.0
    sum_n2: float = 0.0

    def add(self, n: int, p: int) -> None:
        self.num_seqs += 1
        self.sum_n += n
        self.sum_np += n * p
        self.sum_n2 += n * n

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.num_seqs, self.sum_n, self.sum_np, self.sum_n2])

    @classmethod
    def of(cls, chunks: Sequence[tuple[int, int]]) -> StepFeatures:
        f = cls()
        for n, p in chunks:
            f.add(n, p)
        return f


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int  # = number of SWA slots
    max_num_batched_tokens: int = 32768
    max_model_len: int = 1 << 20
    enable_prefix_caching: bool = True
    # Tokens replayed before a prefix hit to rebuild the sliding-window state exactly:
    # sliding_window * num_layers of the model. None replays the whole hit.
    max_replay_tokens: int | None = None
    model_id: str = ""
    # Step-time target for chunk sizing with the cost model; None: token budget only.
    step_time_target_s: float | None = None
    # The first prefill chunk of a step gets at least this many tokens even when decodes alone
    # already exceed the time target (prefills must make progress).
    min_chunk_tokens: int = 64
    max_num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise SchedulerError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step and what its logit rows mean.

    The step's logits are ``[prompt-logprob rows][sample rows]``, the last ``num_logits``
    positions of the SeqStep: row j of the prompt part scores prompt token j+1."""

    request_id: str
    step: SeqStep
    num_replay_tokens: int  # positions below write_from: rebuild SWA state only
    num_draft_tokens: int
    num_sample_rows: int  # 1 + drafts when the step reaches the last known token, else 0
    first_prompt_logprob_row: int
    num_prompt_logprob_rows: int
    has_placeholder: bool
    preemption_epoch: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the previous schedule()
    features: StepFeatures = field(default_factory=StepFeatures)
    predicted_time_s: float | None = None
    # (request id, its SeqStep's token_ids, index of the placeholder there) for every scheduled
    # placeholder, so the device thread fills them without scanning the whole step
    placeholders: list[tuple[str, list[int], int]] = field(default_factory=list)
    num_logits: int = 0  # sum of the SeqSteps' num_logits

    @property
    def batch(self) -> ForwardBatch:
        return ForwardBatch([s.step for s in self.scheduled])

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.step.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    num_rejected: int
    finish_status: RequestStatus | None


@dataclass(slots=True)
class StepBudget:
    num_tokens_left: int
    features: StepFeatures  # the step's features so far (the SchedulerOutput's, shared)
    step_no: int
    # Set only when a fitted cost model and a step-time target are both present: chunks are then
    # sized by predicted time, otherwise by tokens alone.
    cost_model: CostModel | None = None
    time_target_s: float | None = None
    min_chunk_tokens: int = 0
    num_chunks: int = 0  # chunks of more than one token emitted so far
    # Requests preempted in this step: admission holds them back until the next one.
    preempted_ids: set[str] = field(default_factory=set)

    @classmethod
    def for_step(
        cls, config: SchedulerConfig, cost_model: CostModel | None, features: StepFeatures, step_no: int
    ) -> StepBudget:
        budget = cls(config.max_num_batched_tokens, features, step_no)
        if cost_model is not None and cost_model.is_fitted and config.step_time_target_s:
            budget.cost_model = cost_model
            budget.time_target_s = config.step_time_target_s
            budget.min_chunk_tokens = config.min_chunk_tokens
        return budget

    def chunk_size(self, prefix: int, wanted: int) -> int:
        """Tokens the next chunk of a sequence with ``prefix`` computed tokens may take, at most
        ``wanted``. The step's first chunk gets at least ``min_chunk_tokens`` even when decodes
        alone already exceed the time target, so prefills keep making progress."""
        n = min(wanted, self.num_tokens_left)
        if self.time_target_s is not None and n > 1:
            fit = self.cost_model.max_chunk(self.features, prefix, self.time_target_s, n)
            floor = min(n, self.min_chunk_tokens) if self.num_chunks == 0 else 0
            n = max(fit, floor)
        return n


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._members: dict[str, Request] = {}
        self._num_pushes = 0  # tie-break so a re-pushed request never compares Request objects

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return self._members.get(request.request_id) is request

    def __iter__(self) -> Iterator[Request]:
        """Members in scheduling order (sorts; for tests and stats, not the hot path)."""
        return iter(sorted(self._members.values(), key=lambda r: r.sort_key))

    def push(self, request: Request) -> None:
        if request.request_id in self._members:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._members[request.request_id] = request
        self._num_pushes += 1
        heapq.heappush(self._heap, (*request.sort_key, self._num_pushes, request))

    def peek(self) -> Request | None:
        self._drop_stale()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._drop_stale()
        request = heapq.heappop(self._heap)[3]
        del self._members[request.request_id]
        return request

    def remove(self, request: Request) -> bool:
        """Lazy removal (abort): the heap entry is skipped when it reaches the top."""
        if self._members.get(request.request_id) is request:
            del self._members[request.request_id]
            return True
        return False

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and self._members.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)
