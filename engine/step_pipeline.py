"""Depth-1 step overlap on a thread executor: the blocking twin of AsyncEngine's loop.

The executor thread runs ``device_step``: the forward, then sampling on tensors. Meanwhile the
caller's thread schedules N+1; once N's tokens are back it launches N+1 (placeholders filled),
commits N (scheduler update, grammar, detokenize, stop strings) and prepares N+1's sampling
inputs, all while N+1's forward runs. See engine_core.py for the exact order and why it is safe.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

from deepinfer.engine.engine_core import EngineCore, SampledStep, SamplingPrep, StepPlan
from deepinfer.engine.outputs import RequestOutput


class StepPipeline:
    def __init__(self, core: EngineCore, executor: Executor) -> None:
        self.core = core
        self.executor = executor
        self._inflight: tuple[StepPlan, Future[SampledStep]] | None = None

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Commit the step in flight (launching the next one first); [] when idle."""
        core = self.core
        if self._inflight is None:
            plan = core.schedule_step()
            if plan.is_empty:
                return []
            self._inflight = (plan, self.executor.submit(core.device_step, plan, core.prepare_sampling(plan)))
        plan, result = self._inflight
        nxt = core.schedule_step()  # overlaps the device step of `plan`
        sampled = result.result()
        prep: Future[SamplingPrep] = Future()
        if nxt.is_empty:
            self._inflight = None
        else:
            core.fill_placeholders(nxt, sampled)
            self._inflight = (nxt, self.executor.submit(core.device_step, nxt, prep))
        try:
            outputs = core.commit_step(plan, sampled)  # overlaps the forward of `nxt`
            if not nxt.is_empty:
                prep.set_result(core.prepare_sampling(nxt))  # needs `plan` committed
        except BaseException as e:
            prep.set_exception(e)  # never leave the device thread waiting
            raise
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without launching another (before shutdown)."""
        if self._inflight is None:
            return []
        plan, result = self._inflight
        self._inflight = None
        return self.core.commit_step(plan, result.result())
