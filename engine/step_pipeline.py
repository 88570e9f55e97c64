"""Depth-1 step overlap on a thread executor: the blocking twin of AsyncEngine's loop.

While ``execute(N)`` runs in the executor, the caller's thread schedules N+1; after sampling N
it launches N+1 and then commits N (scheduler update, grammar, detokenize, stop strings) while
the device computes. See engine_core.py for the exact order and why it is safe.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import torch

from deepinfer.engine.engine_core import EngineCore, StepPlan
from deepinfer.engine.outputs import RequestOutput


class StepPipeline:
    def __init__(self, core: EngineCore, executor: Executor) -> None:
        self.core = core
        self.executor = executor
        self._inflight: tuple[StepPlan, Future[torch.Tensor]] | None = None

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Commit the step in flight (launching the next one first); [] when idle."""
        core = self.core
        if self._inflight is None:
            plan = core.schedule_step()
            if plan.is_empty:
                return []
            self._inflight = (plan, self.executor.submit(core.execute, plan))
        plan, future = self._inflight
        nxt = core.schedule_step()  # overlaps execute(plan)
        sampled = core.sample_step(plan, future.result())
        if nxt.is_empty:
            self._inflight = None
        else:
            core.fill_placeholders(nxt, sampled)
            self._inflight = (nxt, self.executor.submit(core.execute, nxt))
        return core.commit_step(plan, sampled)  # overlaps execute(nxt)

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without launching another (before shutdown)."""
        if self._inflight is None:
            return []
        plan, future = self._inflight
        self._inflight = None
        return self.core.commit_step(plan, self.core.sample_step(plan, future.result()))
