"""Blocking step drivers for tests and benchmarks (production code steps only through StepLoop).

    step(core)                       one serial step on the caller's thread: schedule, forward,
                                     sample, commit; [] when nothing could be scheduled
    StepPipeline(core, executor)     the engine's AsyncStepPipeline (engine/core/step_loop.py),
                                     each step() awaited on a private event loop: the same
                                     pipelined order, one step in flight between calls
"""

from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import Executor

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.step_loop import AsyncStepPipeline


def step(core: EngineCore) -> list[RequestOutput]:
    plan = core.schedule_step()
    if plan.is_empty:
        return []
    logits = core.execute(plan)
    return core.commit_step(plan, core.sample_step(plan, logits))


class StepPipeline:
    def __init__(self, core: EngineCore, executor: Executor, *, feed_ids: bool | None = None) -> None:
        """``executor`` must run jobs in order on one thread (ThreadPoolExecutor(1))."""
        self.core = core
        self._loop = asyncio.new_event_loop()
        self._finalizer = weakref.finalize(self, self._loop.close)
        self._pipe = AsyncStepPipeline(core, executor, feed_ids=feed_ids)

    def has_work(self) -> bool:
        return self._pipe.has_work()

    def step(self) -> list[RequestOutput]:
        """Commit the step in flight (having queued the next one first); [] when idle."""
        return self._loop.run_until_complete(self._pipe.step())

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without scheduling another."""
        return self._loop.run_until_complete(self._pipe.drain())
