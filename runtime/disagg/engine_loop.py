"""The step loop of a disaggregated engine: one ``EngineCore``, its forwards on a device thread.

    loop = EngineLoop(core, on_scheduled=capture_hook, name="prefill-0")       # one step at a time
    loop = EngineLoop(core, name="decode-0", is_pipelined=True)               # step overlap
    loop.start(); loop.add_sink(rid, callback); await loop.between_steps(job); await loop.stop()

Every output goes to its request's sink (on the event loop, right after its step commits).
Between-step jobs (``between_steps``) run on the event loop while *no step is in flight*: they
may read or write the runner's KV (a decode imports a handoff into blocks + a slot) without
racing a forward.

Serial (prefill): schedule -> ``on_scheduled(plan)`` -> forward + sampling (device thread,
awaited) -> commit -> sinks -> jobs. A prefill exports a finished request's blocks from its sink,
right after the step that sampled its token commits and before the next step can reuse them:
commit -> export must stay adjacent, so the prefill loop stays serial (its overlap comes from
its peers).

Pipelined (decode): ``AsyncStepPipeline`` (engine/core/step_loop.py), as in the co-located
engine: step N+1 is scheduled and handed to the device thread while N's forward runs, and N
commits during N+1's forward, so the device never waits for the bookkeeping. A step is
(almost) always in flight, so jobs need a point where none is:

    device: | fwd N | fwd N+1 |                                 | fwd N+2 | fwd N+3 | ...
    loop:        commit N    commit N+1, import, schedule N+2, N+3
                   ^ an import is queued: wait for N+1 instead of scheduling N+2 (drain)

When jobs are queued the loop drains: the step in flight finishes and commits, the jobs run,
then the pipeline restarts with a fresh schedule (imported requests join it there). Why drain
rather than import beside a running forward: an import allocates its blocks and slot from the
pool, and the pool hands out blocks freed by requests that finished or were aborted while steps
were in flight; those steps still write KV into them (their results are dropped at commit, the
writes are not), so only a step boundary with nothing in flight makes the import's writes
final. Steady decoding stays pipelined; each burst of imports costs one un-overlapped step, the
cost every step paid before. A decode checks that it has room before queueing an import
(decode.py), so a full engine waiting for room does not drain at every retry. On the CPU with a
tiny model the forward is mostly interpreter work, so the GIL caps what the overlap can hide;
on a GPU the device thread waits on the device without holding it.

Failures never strand anything: a failed step (or commit) fails every request this engine
holds (the failed step's and the one queued behind it share positions; the device thread is
awaited first), drops the prefix cache (a failed forward may have written garbage into cached
blocks) and the loop serves on. ``stop`` fails every sink and queued job, then joins the device
thread (a step queued behind a cancelled commit gets the error instead of its sampling inputs).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deepinfer.engine.core.engine_core import EngineCore, StepPlan
from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.core.step_loop import AsyncStepPipeline

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]

_IDLE_POLL_S = 0.002  # nothing schedulable (requests waiting for room): retry after this


class EngineLoop:
    def __init__(self, core: EngineCore, *, on_scheduled: Callable[[StepPlan], None] | None = None,
                 name: str = "engine", is_pipelined: bool = False, switch_interval_s: float | None = None):
        """``switch_interval_s``: the CPython GIL switch interval a pipelined loop sets when it
        starts (process-wide, as ``AsyncEngine`` does; None: leave it)."""
        if is_pipelined and on_scheduled is not None:
            raise ValueError("on_scheduled needs the serial loop: a pipelined loop schedules inside its pipeline")
        self.core = core
        self.name = name
        self.is_pipelined = is_pipelined
        self.num_steps = 0
        self.num_drains = 0  # pipelined: how often queued jobs stopped a step in flight
        self.last_step_s = 0.0
        self._on_scheduled = on_scheduled
        self._switch_interval_s = switch_interval_s
        self._sinks: dict[str, Sink] = {}
        self._jobs: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-device")
        self._pipe = AsyncStepPipeline(core, self._executor) if is_pipelined else None
        self._task: asyncio.Task | None = None
        self._is_stopped = False

    # ---- requests ----------------------------------------------------------------------------
    def add_sink(self, engine_request_id: str, sink: Sink) -> None:
        self._sinks[engine_request_id] = sink
        self._wake.set()

    def abort(self, engine_request_id: str) -> bool:
        """Abort one engine request (its sink is dropped, not called). True if it was known.
        A step in flight drops its result; its blocks go only to steps scheduled after it."""
        had = self._sinks.pop(engine_request_id, None) is not None
        self.core.abort([engine_request_id])
        return had

    def wake(self) -> None:
        self._wake.set()

    async def between_steps(self, job: Callable[[], Any]) -> Any:
        """Run ``job()`` on the event loop when no step is in flight; returns its result (or
        raises its error). Raises RuntimeError once the loop is stopped."""
        if self._is_stopped:
            raise RuntimeError(f"engine {self.name} stopped")
        future = asyncio.get_running_loop().create_future()
        self._jobs.append((job, future))
        self._wake.set()
        return await future

    @property
    def num_requests(self) -> int:
        return self.core.scheduler.num_unfinished

    @property
    def has_work(self) -> bool:
        """Requests to step or a step in flight (False: the device thread is idle)."""
        return self._pipe.has_work() if self._pipe is not None else self.core.has_unfinished_requests()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.is_pipelined and self._switch_interval_s is not None:
            # The device thread needs the GIL to start the next forward the moment a step's
            # sampling ends, while this thread commits; with CPython's default 5 ms the commit
            # (~2 ms) keeps it and the next forward waits for the whole commit.
            sys.setswitchinterval(self._switch_interval_s)
        run = self._run_pipelined() if self.is_pipelined else self._run_serial()
        self._task = asyncio.create_task(run, name=f"{self.name}-steps")

    async def stop(self) -> None:
        self._is_stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        stopped = RuntimeError(f"engine {self.name} stopped")
        for rid in list(self._sinks):
            self._fail(rid, stopped)
        jobs, self._jobs = self._jobs, []
        for _, future in jobs:
            if not future.done():
                future.set_exception(stopped)
        # off the event loop: the device thread may still finish the forward it is running
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True, cancel_futures=True))

    # ---- serial ------------------------------------------------------------------------------
    async def _run_serial(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            self._run_jobs()
            if not core.has_unfinished_requests():
                await self._park()
                continue
            plan = core.schedule_step()
            if self._on_scheduled is not None:
                self._on_scheduled(plan)
            if plan.is_empty:  # waiting requests that do not fit yet: let jobs and aborts run
                await asyncio.sleep(_IDLE_POLL_S)
                continue
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
            self.num_steps += 1
            self._deliver(outputs)

    # ---- pipelined ---------------------------------------------------------------------------
    async def _run_pipelined(self) -> None:
        loop = asyncio.get_running_loop()
        pipe, core = self._pipe, self.core
        while True:
            if self._jobs:
                await self._drain()
                self._run_jobs()
            if not pipe.has_work():
                await self._park()
                continue
            num_committed = core.num_steps
            t0 = loop.time()
            try:
                outputs = await pipe.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._fail_held(exc)
                continue
            if core.num_steps == num_committed:  # nothing schedulable and nothing in flight
                await asyncio.sleep(_IDLE_POLL_S)
                continue
            self.last_step_s = loop.time() - t0
            self.num_steps += 1
            self._deliver(outputs)

    async def _drain(self) -> None:
        """Let the step in flight finish and commit; afterwards the device thread is idle."""
        num_committed = self.core.num_steps
        try:
            outputs = await self._pipe.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail_held(exc)
            return
        if self.core.num_steps != num_committed:  # a step was in flight
            self.num_steps += 1
            self.num_drains += 1
        self._deliver(outputs)
        if self.core.kv_offload is not None:
            # an idle pipeline queues write-behind block copies on the device thread: they read
            # blocks a job may overwrite, so let them finish first
            await asyncio.get_running_loop().run_in_executor(self._executor, _noop)

    async def _fail_held(self, exc: Exception) -> None:
        """A step or commit failed: fail every request held here, drop the prefix cache."""
        log.error("%s: step failed: %s: %s", self.name, type(exc).__name__, exc, exc_info=exc)
        # the step queued behind the failed one fails too (same error); wait until it has ended
        await asyncio.get_running_loop().run_in_executor(self._executor, _noop)
        core = self.core
        held = list(core.scheduler.requests)
        error = RuntimeError(f"engine {self.name} step failed: {exc}")
        for rid in held:
            self._fail(rid, error)
        core.abort({core.parent_id(rid) for rid in held})
        core.scheduler.pool.evict_all_unreferenced()

    # ---- shared ------------------------------------------------------------------------------
    async def _park(self) -> None:
        self._wake.clear()
        if not self._jobs:
            await self._wake.wait()

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


def _noop() -> None:
    return None
