"""Depth-1 step overlap on a one-thread executor: the blocking twin of AsyncEngine's loop.

The executor's single worker runs ``device_step`` jobs back to back: job N+1 is queued as soon as
step N+1 is scheduled (while N's forward runs), and when the worker reaches it, it writes N's
sampled tokens into N+1's placeholders itself and launches the forward: consecutive forwards
never wait for the caller's thread. The caller's thread meanwhile commits N (scheduler update,
grammar, detokenize, stop strings) and prepares N+1's sampling inputs, which the worker needs
only after N+1's forward. See engine_core.py for why this order is safe.

Timeline (D = device worker, M = caller's thread):
    D: | fwd N | sample N | fill N+1 | fwd N+1 | sample N+1 | fill N+2 | fwd N+2 ...
    M:   sched N+1 .. wait N | commit N, prepare N+1, sched N+2 .. wait N+1 | commit N+1 ...
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future

from deepinfer.engine.engine_core import EngineCore, SampledStep, SamplingPrep, StepPlan
from deepinfer.engine.outputs import RequestOutput


class StepPipeline:
    def __init__(self, core: EngineCore, executor: Executor) -> None:
        """``executor`` must run jobs in order on one thread (ThreadPoolExecutor(1))."""
        self.core = core
        self.executor = executor
        self._inflight: tuple[StepPlan, Future[SampledStep], Future[SamplingPrep]] | None = None

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Commit the step in flight (having queued the next one first); [] when idle."""
        core = self.core
        if self._inflight is None:
            plan = core.schedule_step()
            if plan.is_empty:
                return []
            prep: Future[SamplingPrep] = Future()
            prep.set_result(core.prepare_sampling(plan))
            self._inflight = (plan, self.executor.submit(core.device_step, plan, prep, None), prep)
        plan, result, _ = self._inflight
        nxt = core.schedule_step()  # overlaps the forward of `plan`
        nxt_prep: Future[SamplingPrep] = Future()
        self._inflight = None
        if not nxt.is_empty:
            # queued behind `plan` on the same worker: starts the moment plan's sampling ends
            self._inflight = (nxt, self.executor.submit(core.device_step, nxt, nxt_prep, result), nxt_prep)
        try:
            sampled = result.result()
            outputs = core.commit_step(plan, sampled)  # overlaps the forward of `nxt`
            if not nxt.is_empty:
                nxt_prep.set_result(core.prepare_sampling(nxt))  # needs `plan` committed
        except BaseException as e:
            if not nxt_prep.done():
                nxt_prep.set_exception(e)  # never leave the worker waiting
            self._inflight = None
            raise
        if nxt.is_empty and core.kv_offload is not None:  # [kv-tiers hook] idle: write behind now
            core.kv_offload.submit_idle_device_io(self.executor)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without scheduling another (before shutdown)."""
        if self._inflight is None:
            return []
        plan, result, _ = self._inflight
        self._inflight = None
        return self.core.commit_step(plan, result.result())


class AsyncStepPipeline:
    """``StepPipeline`` for asyncio: identical order, awaiting the device worker instead of
    blocking, so the event loop keeps serving (HTTP, add_request, abort) during forwards."""

    def __init__(self, core: EngineCore, executor: Executor) -> None:
        self.core = core
        self.executor = executor
        self._inflight: tuple[StepPlan, Future[SampledStep], Future[SamplingPrep]] | None = None

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    async def step(self) -> list[RequestOutput]:
        core = self.core
        if self._inflight is None:
            plan = core.schedule_step()
            if plan.is_empty:
                return []
            prep: Future[SamplingPrep] = Future()
            prep.set_result(core.prepare_sampling(plan))
            self._inflight = (plan, self.executor.submit(core.device_step, plan, prep, None), prep)
        plan, result, _ = self._inflight
        nxt = core.schedule_step()
        nxt_prep: Future[SamplingPrep] = Future()
        self._inflight = None
        if not nxt.is_empty:
            self._inflight = (nxt, self.executor.submit(core.device_step, nxt, nxt_prep, result), nxt_prep)
        try:
            sampled = await asyncio.wrap_future(result)
            outputs = core.commit_step(plan, sampled)
            if not nxt.is_empty:
                nxt_prep.set_result(core.prepare_sampling(nxt))
        except BaseException as e:
            if not nxt_prep.done():
                nxt_prep.set_exception(e)
            self._inflight = None
            raise
        if nxt.is_empty and core.kv_offload is not None:  # [kv-tiers hook] idle: write behind now
            core.kv_offload.submit_idle_device_io(self.executor)
        return outputs

    async def drain(self) -> list[RequestOutput]:
        if self._inflight is None:
            return []
        plan, result, _ = self._inflight
        self._inflight = None
        return self.core.commit_step(plan, await asyncio.wrap_future(result))
