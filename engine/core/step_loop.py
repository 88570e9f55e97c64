"""The one step loop: every engine role drives its ``EngineCore`` through ``StepLoop``.

``AsyncEngine`` (co-located serving, embedding, ``LLM``) and the prefill / decode engine services
(runtime/disagg) build a ``StepLoop`` with their hooks; nothing else steps an engine. Its
variants are parameters, not copies:

- ``is_pipelined``: serial (schedule, forward, commit, one after the other) or pipelined (step
  N+1 scheduled and handed to the device thread while N's forward runs; N commits during N+1's
  forward). With DSpark a step that samples is committed before the next is scheduled (that
  one verifies the drafts made after its sampling; engine/spec/decoding.py). The order of work on both threads is drawn once, in ARCHITECTURE.md ("The step
  timeline"); ``AsyncStepPipeline`` below implements it over ``DeviceChain`` (device_chain.py).
- ``StepHooks``: ``deliver`` gets every step's outputs right after its commit (a prefill exports a
  finished request's KV from there, before the next step can reuse its blocks); ``on_scheduled``
  sees each plan before its forward (serial only: a prefill captures block tables there);
  ``fail`` hands the requests a failed step ended to their owner.
- jobs between steps (``between_steps``): run on the event loop while no step is in flight, e.g.
  a decode importing a handed-over request's KV; a pipelined loop drains the step in flight first.
- ``FailurePolicy``: which requests a failed step ends and whether the prefix cache is dropped.

A failed step never hangs anything: the step queued behind it fails too, the device thread is
awaited, the policy's requests are failed and aborted, and the loop serves on. Nothing to run
but requests waiting (for blocks, for KV still being read) costs one ``IDLE_BACKOFF_S`` wait.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import sys
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.core.device_chain import DeviceChain, StepSlot
from deepinfer.engine.core.engine_core import EngineCore, StepPlan

log = logging.getLogger(__name__)

# Nothing schedulable but requests waiting (for blocks a finishing step frees, for KV tier
# reads): wait this long, or until new work wakes the loop, before scheduling again.
IDLE_BACKOFF_S = 0.002


def tune_interpreter(switch_interval_s: float | None = 0.0005, *, freeze_gc: bool = False,
                     gen0_threshold: int = 50_000) -> None:
    """The process-wide CPython settings of an engine process (the one place that sets them).

    - A short GIL switch interval: the device thread needs the GIL to launch the next forward
      the moment a step's sampling ends, while the loop's thread commits (with CPython's default
      5 ms, a ~2 ms commit keeps it and the next forward waits for the whole commit). None: leave it.
    - ``freeze_gc``: freeze everything allocated so far (model, tokenizer, caches) out of the
      cyclic GC and collect young objects less often: per-step bookkeeping allocates thousands of
      small objects and with default thresholds the collector rescans long-lived state many times
      a step (it doubled commit time at batch 256)."""
    if freeze_gc:
        gc.collect()
        gc.freeze()
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, gen1, gen2)
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)


class AsyncStepPipeline:
    """One step per ``step()``: commits the step in flight (pipelined: after handing the next one
    over) and returns its outputs; [] when nothing could be scheduled and nothing was in flight."""

    def __init__(self, core: EngineCore, executor: Executor, *, is_pipelined: bool = True,
                 on_scheduled: Callable[[StepPlan], None] | None = None, feed_ids: bool | None = None) -> None:
        """``executor`` must run jobs in order on one thread (ThreadPoolExecutor(1)); ``feed_ids``:
        device-fed ids of decode steps (device_chain.py; None: on when the logits are not on the CPU)."""
        if is_pipelined and on_scheduled is not None:
            raise ValueError("on_scheduled needs the serial loop: a pipelined loop schedules inside its pipeline")
        self.core = core
        self.executor = executor
        self.is_pipelined = is_pipelined
        self._on_scheduled = on_scheduled
        self._chain = DeviceChain(core, executor, feed_ids=feed_ids)
        self._inflight: StepSlot | None = None
        self.current: StepPlan | None = None  # the plan being committed (a failed step's requests)

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    async def step(self) -> list[RequestOutput]:
        slot, queued = self._queue_next(asyncio.get_running_loop())
        if slot is None:
            return []
        self.current = slot.plan
        try:
            outputs = self.core.commit_step(slot.plan, await slot.wait())  # overlaps `queued`'s forward
            if queued is not None:
                queued.set_prep(self.core.prepare_sampling(queued.plan))  # needs `slot` committed
        except BaseException as e:
            if queued is not None:
                queued.set_prep_error(e)  # never leave the device thread waiting
            self._inflight = None
            raise
        if queued is None and self.core.kv_offload is not None:
            # [kv-tiers hook] idle (a serial loop always is between steps): write the last commit's
            # blocks behind now (engine/kv/offload.py), not at a next step that may never come
            self.core.kv_offload.submit_idle_device_io(self.executor)
        return outputs

    async def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without scheduling another (before jobs or shutdown)."""
        slot, self._inflight = self._inflight, None
        if slot is None:
            return []
        self.current = slot.plan
        return self.core.commit_step(slot.plan, await slot.wait())

    def _queue_next(self, loop: asyncio.AbstractEventLoop) -> tuple[StepSlot | None, StepSlot | None]:
        """Hand the next step over (behind the one in flight when pipelined); returns (the step
        to commit now, the step queued behind it)."""
        core = self.core
        slot = self._inflight
        if slot is None:
            plan = core.schedule_step()
            if self._on_scheduled is not None:
                self._on_scheduled(plan)
            if plan.is_empty:
                return None, None
            slot = StepSlot(plan, None, loop=loop)
            slot.set_prep(core.prepare_sampling(plan))
            self._chain.submit(slot)
        self._inflight = None
        if not self.is_pipelined:
            return slot, None
        spec = core.hooks.spec
        if spec is not None and spec.must_commit_first(slot.plan):
            return slot, None  # the next step verifies the drafts this one's sampling yields
        nxt = core.schedule_step()  # overlaps the forward of `slot`
        if nxt.is_empty:
            return slot, None
        # resolved here, hidden behind the forward, so the device thread's fill is a flat loop
        queued = StepSlot(nxt, slot, core.placeholder_rows(nxt, slot.prep), loop=loop)
        self._chain.submit(queued)  # starts the moment slot's sampling ends
        self._inflight = queued
        return slot, queued


class FailureScope(enum.Enum):
    RUNNING = "running"  # running requests and waiting ones with a token in flight (co-located)
    HELD = "held"  # every request the engine holds (a decode: all of them share the failed steps)
    SCHEDULED = "scheduled"  # the failed plan's requests (serial: nothing else was touched)


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    scope: FailureScope = FailureScope.RUNNING
    # a failed forward may have written garbage into blocks the prefix cache would hand out
    evict_prefix_cache: bool = True


def _ignore_failure(request_ids: list[str], error: Exception) -> None:
    return None


@dataclass(slots=True)
class StepHooks:
    deliver: Callable[[list[RequestOutput]], None]  # every step's outputs, right after its commit
    # engine request ids a failed step ended, before they are aborted, and the step's error
    fail: Callable[[list[str], Exception], None] = _ignore_failure
    on_scheduled: Callable[[StepPlan], None] | None = None  # serial loops only


class StepLoop:
    def __init__(self, core: EngineCore, executor: Executor, hooks: StepHooks, *, name: str = "engine",
                 is_pipelined: bool = True, failure: FailurePolicy = FailurePolicy(),
                 check_integrity: bool = False) -> None:
        """``executor``: the device thread (a one-thread executor, shut down by the owner)."""
        self.core = core
        self.executor = executor
        self.hooks = hooks
        self.name = name
        self.is_pipelined = is_pipelined
        self.failure = failure
        self.check_integrity = check_integrity
        self.pipe = AsyncStepPipeline(core, executor, is_pipelined=is_pipelined, on_scheduled=hooks.on_scheduled)
        self.num_steps = 0  # committed steps
        self.num_drains = 0  # pipelined: how often queued jobs stopped a step in flight
        self.num_failed_steps = 0
        self.num_failures_in_row = 0
        self.last_step_s = 0.0
        self._jobs: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._is_closing = False

    # ---- work in -----------------------------------------------------------------------------
    def wake(self) -> None:
        """New work (a request, an abort that may unblock others): stop idling now."""
        self._wake.set()

    def has_work(self) -> bool:
        """Requests to step or a step in flight (False: the device thread is idle)."""
        return self.pipe.has_work()

    async def between_steps(self, job: Callable[[], Any]) -> Any:
        """Run ``job()`` on the event loop when no step is in flight; returns its result (or
        raises its error). The owner fails jobs still queued when it stops (``fail_jobs``)."""
        future = asyncio.get_running_loop().create_future()
        self._jobs.append((job, future))
        self._wake.set()
        return await future

    def fail_jobs(self, error: BaseException) -> None:
        jobs, self._jobs = self._jobs, []
        for _, future in jobs:
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        """Let ``run`` return once nothing is left to step (the step in flight is drained)."""
        self._is_closing = True
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        pipe, core = self.pipe, self.core
        while True:
            if self._jobs:
                if self.is_pipelined:
                    await self._drain()
                self._run_jobs()
            if not pipe.has_work():
                if self._is_closing:
                    break
                self._wake.clear()
                if not self._jobs:
                    await self._wake.wait()
                continue
            num_committed = core.num_steps
            t0 = loop.time()
            try:
                outputs = await pipe.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed step must never hang its requests
                await self._fail_step(exc)
                continue
            self.num_failures_in_row = 0
            is_committed = core.num_steps != num_committed
            if is_committed:
                self.last_step_s = loop.time() - t0
                self.num_steps += 1
            self.hooks.deliver(outputs)
            if self.check_integrity:
                core.check_integrity()
            if not is_committed:
                # nothing could be scheduled (e.g. waiting for blocks a finished step frees):
                # wait until something changes instead of spinning
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_BACKOFF_S)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let consumers and new requests in between steps
        await pipe.drain()

    async def _drain(self) -> None:
        """Let the step in flight finish and commit; afterwards the device thread is idle."""
        num_committed = self.core.num_steps
        try:
            outputs = await self.pipe.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await self._fail_step(exc)
            return
        if self.core.num_steps != num_committed:  # a step was in flight
            self.num_steps += 1
            self.num_drains += 1
        self.hooks.deliver(outputs)
        if self.core.kv_offload is not None:
            # an idle pipeline queues write-behind block copies on the device thread: they read
            # blocks a job may overwrite, so let them finish first
            await self.device_idle()

    def _run_jobs(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job, future in jobs:
            if future.done():
                continue
            try:
                future.set_result(job())
            except Exception as exc:  # noqa: BLE001 - handed to whoever queued the job
                future.set_exception(exc)

    async def device_idle(self) -> None:
        """Return once every job queued on the device thread so far has run."""
        await asyncio.get_running_loop().run_in_executor(self.executor, _noop)

    async def _fail_step(self, error: Exception) -> None:
        """A step (or its commit) failed: end the requests the policy names, drop the prefix
        cache if asked, and serve on. The step queued behind a failed one fails with it."""
        self.num_failed_steps += 1
        self.num_failures_in_row += 1
        log.error("%s: engine step failed: %s: %s", self.name, type(error).__name__, error, exc_info=error)
        await self.device_idle()  # the queued step has ended
        core, sched = self.core, self.core.scheduler
        scope = self.failure.scope
        if scope is FailureScope.SCHEDULED:
            plan = self.pipe.current
            ids = [s.request_id for s in plan.sched.scheduled] if plan is not None else []
            ids = [rid for rid in ids if rid in sched.requests]
        elif scope is FailureScope.HELD:
            ids = list(sched.requests)
        else:
            # running requests may have positions of the failed steps; a preempted one with a
            # token in flight waits for a commit that will never come
            ids = [r.request_id for r in sched.running]
            ids += [r.request_id for r in sched.waiting if r.num_output_placeholders > 0]
        self.hooks.fail(ids, error)
        core.abort({core.parent_id(rid) for rid in ids})
        if self.failure.evict_prefix_cache:
            sched.pool.evict_all_unreferenced()


def _noop() -> None:
    return None
