"""Plain values the scheduler takes and returns (config, one step's plan, commit results)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.api.protocol import InvalidPromptError
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.sched.cost_model import StepFeatures
from deepinfer.engine.core.request import Request, RequestStatus

# Token id of a position whose token is being sampled by the step in flight (async scheduling);
# the engine writes the real id into SeqStep.token_ids before the step runs.
PLACEHOLDER_TOKEN_ID = -1


class SchedulerError(InvalidPromptError):
    """A request the scheduler cannot take (empty or too long prompt, duplicate id)."""


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
