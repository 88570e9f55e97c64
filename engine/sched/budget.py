"""One ``schedule()`` call's budget: the tokens it has left, the cost features of what it has
scheduled so far, and prefill chunk sizing against the fitted cost model.

SPEC §6 (prefill balancer, inside one GPU): the chunk of a prefill step is not fixed; the cost
model predicts step time from the chunk's token count and its already-computed prefix, and the
scheduler takes the largest chunk that still fits the step-time target within the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.sched.cost_model import CostModel, StepFeatures
from deepinfer.engine.sched.types import SchedulerConfig


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
