"""The step loop of a disaggregated engine: one ``EngineCore``, stepped on a worker thread.

    loop = EngineLoop(core, on_scheduled=capture_hook, name="prefill-0")
    loop.start(); loop.add_sink(rid, callback); loop.wake() ... await loop.stop()

Each iteration: ``schedule_step`` (event loop) -> ``on_scheduled(plan)`` -> forward + sampling
(worker thread, awaited) -> ``commit_step`` (event loop) -> every output to its request's sink
-> queued between-step jobs. Sinks and jobs run on the event loop *between* forwards, so they may
read or write the runner's KV (a prefill exports a finished request's blocks before the next
step can reuse them; a decode imports a handoff) without racing a forward.

Deliberately not pipelined (one step in flight at most): a disaggregated engine's overlap comes
from its peers, and keeping commit -> export adjacent is what makes capture exact.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deepinfer.engine.engine_core import EngineCore, StepPlan
from deepinfer.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    def __init__(self, core: EngineCore, *, on_scheduled: Callable[[StepPlan], None] | None = None,
                 name: str = "engine"):
        self.core = core
        self.name = name
        self.num_steps = 0
        self.last_step_s = 0.0
        self._on_scheduled = on_scheduled
        self._sinks: dict[str, Sink] = {}
        self._jobs: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-device")
        self._task: asyncio.Task | None = None
        self._is_stepping = False

    # ---- requests ----------------------------------------------------------------------------
    def add_sink(self, engine_request_id: str, sink: Sink) -> None:
        self._sinks[engine_request_id] = sink
        self._wake.set()

    def abort(self, engine_request_id: str) -> bool:
        """Abort one engine request (its sink is dropped, not called). True if it was known."""
        had = self._sinks.pop(engine_request_id, None) is not None
        self.core.abort([engine_request_id])
        return had

    def wake(self) -> None:
        self._wake.set()

    async def between_steps(self, job: Callable[[], Any]) -> Any:
        """Run ``job()`` on the event loop when no forward is in flight; returns its result."""
        future = asyncio.get_running_loop().create_future()
        if not self._is_stepping:
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)
            return await future
        self._jobs.append((job, future))
        return await future

    @property
    def num_requests(self) -> int:
        return self.core.scheduler.num_unfinished

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-steps")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for rid in list(self._sinks):
            self._fail(rid, RuntimeError(f"engine {self.name} stopped"))
        self._run_jobs()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            self._run_jobs()
            if not core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = core.schedule_step()
            if self._on_scheduled is not None:
                self._on_scheduled(plan)
            if plan.is_empty:  # waiting requests that do not fit yet: let jobs and aborts run
                await asyncio.sleep(0.002)
                continue
            self._is_stepping = True
            try:
                t0 = loop.time()
                sampled = await loop.run_in_executor(self._executor, _forward_and_sample, core, plan)
                self.last_step_s = loop.time() - t0
                outputs = core.commit_step(plan, sampled)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed step fails its requests, never the process
                log.exception("%s: step failed", self.name)
                for s in plan.sched.scheduled:
                    self._fail(s.request_id, RuntimeError(f"engine {self.name} step failed: {exc}"))
                    core.abort([s.request_id])
                continue
            finally:
                self._is_stepping = False
            self.num_steps += 1
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
                if sink is not None:
                    try:
                        sink(out)
                    except Exception:
                        log.exception("%s: output sink of %s failed", self.name, out.request_id)

    def _run_jobs(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job, future in jobs:
            if future.done():
                continue
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)

    def _fail(self, rid: str, error: BaseException) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            try:
                sink(error)
            except Exception:
                log.exception("%s: output sink of %s failed", self.name, rid)


def _forward_and_sample(core: EngineCore, plan: StepPlan):
    return core.sample_step(plan, core.execute(plan))
