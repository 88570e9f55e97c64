"""A disaggregated engine's step loop: the engine's one ``StepLoop`` with sinks and jobs.

    loop = EngineLoop(core, on_scheduled=capture_hook, name="prefill-0")       # one step at a time
    loop = EngineLoop(core, name="decode-0", is_pipelined=True)               # step overlap
    loop.start(); loop.add_sink(rid, callback); await loop.between_steps(job); await loop.stop()

Every output goes to its request's sink (on the event loop, right after its step commits: the
``deliver`` hook of engine/core/step_loop.py). Between-step jobs (``between_steps``) run on the
event loop while *no step is in flight*: they may read or write the runner's KV (a decode imports
a handoff into blocks + a slot) without racing a forward.

Serial (prefill): a prefill exports a finished request's blocks from its sink, right after the
step that sampled its token commits and before the next step can reuse them: commit -> export
must stay adjacent, so the prefill loop stays serial (its overlap comes from its peers); a failed
step fails the requests it scheduled.

Pipelined (decode): as in the co-located engine, with one step almost always in flight, so a
queued job drains it first (the step in flight finishes and commits, the jobs run, then the
pipeline restarts with a fresh schedule; imported requests join it there). Why drain rather than
import beside a running forward: an import allocates its blocks and slot from the pool, and the
pool hands out blocks freed by requests that finished or were aborted while steps were in
flight; those steps still write KV into them (their results are dropped at commit, the writes
are not), so only a step boundary with nothing in flight makes the import's writes final. Each
burst of imports costs one un-overlapped step. A decode checks that it has room before queueing
an import (decode.py), so a full engine waiting for room does not drain at every retry. A failed
step fails every request the engine holds (they share the failed steps' positions) and drops
the prefix cache.

``stop`` fails every sink and queued job, then joins the device thread (a step queued behind a
cancelled commit gets the error instead of its sampling inputs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.core.engine_core import EngineCore, StepPlan
from deepinfer.engine.core.step_loop import FailurePolicy, FailureScope, StepHooks, StepLoop, tune_interpreter

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    def __init__(self, core: EngineCore, *, on_scheduled: Callable[[StepPlan], None] | None = None,
                 name: str = "engine", is_pipelined: bool = False, switch_interval_s: float | None = None):
        """``switch_interval_s``: the CPython GIL switch interval a pipelined loop sets when it
        starts (process-wide, as ``AsyncEngine`` does; None: leave it)."""
        self.core = core
        self.name = name
        self.is_pipelined = is_pipelined
        self._switch_interval_s = switch_interval_s if is_pipelined else None
        self._sinks: dict[str, Sink] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-device")
        scope = FailureScope.HELD if is_pipelined else FailureScope.SCHEDULED
        self._steps = StepLoop(core, self._executor,
                               StepHooks(deliver=self._deliver, fail=self._fail_requests, on_scheduled=on_scheduled),
                               name=name, is_pipelined=is_pipelined,
                               failure=FailurePolicy(scope, evict_prefix_cache=is_pipelined))
        self._task: asyncio.Task | None = None
        self._is_stopped = False

    # ---- requests ----------------------------------------------------------------------------
    def add_sink(self, engine_request_id: str, sink: Sink) -> None:
        self._sinks[engine_request_id] = sink
        self._steps.wake()

    def abort(self, engine_request_id: str) -> bool:
        """Abort one engine request (its sink is dropped, not called). True if it was known.
        A step in flight drops its result; its blocks go only to steps scheduled after it."""
        had = self._sinks.pop(engine_request_id, None) is not None
        self.core.abort([engine_request_id])
        return had

    def wake(self) -> None:
        self._steps.wake()

    async def between_steps(self, job: Callable[[], Any]) -> Any:
        """Run ``job()`` on the event loop when no step is in flight; returns its result (or
        raises its error). Raises RuntimeError once the loop is stopped."""
        if self._is_stopped:
            raise RuntimeError(f"engine {self.name} stopped")
        return await self._steps.between_steps(job)

    @property
    def num_requests(self) -> int:
        return self.core.scheduler.num_unfinished

    @property
    def has_work(self) -> bool:
        """Requests to step or a step in flight (False: the device thread is idle)."""
        return self._steps.has_work()

    @property
    def num_steps(self) -> int:
        return self._steps.num_steps

    @property
    def num_drains(self) -> int:
        """Pipelined: how often queued jobs stopped a step in flight."""
        return self._steps.num_drains

    @property
    def last_step_s(self) -> float:
        return self._steps.last_step_s

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        tune_interpreter(self._switch_interval_s)
        self._task = asyncio.create_task(self._steps.run(), name=f"{self.name}-steps")

    async def stop(self) -> None:
        self._is_stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        stopped = RuntimeError(f"engine {self.name} stopped")
        for rid in list(self._sinks):
            self._fail(rid, stopped)
        self._steps.fail_jobs(stopped)
        # off the event loop: the device thread may still finish the forward it is running
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True, cancel_futures=True))

    # ---- step loop hooks ---------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                try:
                    sink(out)
                except Exception:
                    log.exception("%s: output sink of %s failed", self.name, out.request_id)

    def _fail_requests(self, request_ids: list[str], error: Exception) -> None:
        failed = RuntimeError(f"engine {self.name} step failed: {error}")
        for rid in request_ids:
            self._fail(rid, failed)

    def _fail(self, rid: str, error: BaseException) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            try:
                sink(error)
            except Exception:
                log.exception("%s: output sink of %s failed", self.name, rid)
