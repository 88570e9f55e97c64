"""Depth-1 step overlap: the blocking (StepPipeline) and asyncio (AsyncStepPipeline) drivers.

The device thread (``DeviceChain`` on a one-thread executor) runs the handed-over steps back to
back: step N+1 is handed over as soon as it is scheduled (while N's forward runs), and when
N's sampling ends the device thread itself writes N's tokens into N+1's placeholders and starts
N+1's forward: consecutive forwards never wait for the caller's thread. The caller's thread
meanwhile commits N (scheduler update, grammar, detokenize, stop strings) and prepares N+1's
sampling inputs, which the device thread needs only after N+1's forward. See engine_core.py
for why this order is safe.

Timeline (D = device thread, M = caller's thread):
    D: | fwd N | sample N | fill N+1 | fwd N+1 | sample N+1 | fill N+2 | fwd N+2 ...
    M:   sched N+1 .. wait N | commit N, prepare N+1, sched N+2 .. wait N+1 | commit N+1 ...

Both drivers share ``_StepDriver``: the same order, one blocking and one awaiting the result.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from deepinfer.engine.core.device_chain import DeviceChain, StepSlot
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.api.outputs import RequestOutput


class _StepDriver:
    def __init__(self, core: EngineCore, executor: Executor) -> None:
        """``executor`` must run jobs in order on one thread (ThreadPoolExecutor(1))."""
        self.core = core
        self.executor = executor
        self._chain = DeviceChain(core, executor)
        self._inflight: StepSlot | None = None

    def has_work(self) -> bool:
        return self._inflight is not None or self.core.has_unfinished_requests()

    def _queue_next(self, loop: asyncio.AbstractEventLoop | None) -> tuple[StepSlot | None, StepSlot | None]:
        """Hand the next step over behind the one in flight (starting one when idle); returns
        (the step to commit now, the step queued behind it)."""
        core = self.core
        slot = self._inflight
        if slot is None:
            plan = core.schedule_step()
            if plan.is_empty:
                return None, None
            slot = StepSlot(plan, None, loop=loop)
            slot.set_prep(core.prepare_sampling(plan))
            self._chain.submit(slot)
        nxt = core.schedule_step()  # overlaps the forward of `slot`
        self._inflight = None
        if nxt.is_empty:
            return slot, None
        # resolved here, hidden behind the forward, so the device thread's fill is a flat loop
        rows = core.placeholder_rows(nxt, slot.prep)
        queued = StepSlot(nxt, slot, rows, loop=loop)
        self._chain.submit(queued)  # starts the moment slot's sampling ends
        self._inflight = queued
        return slot, queued

    def _commit(self, slot: StepSlot, queued: StepSlot | None, sampled) -> list[RequestOutput]:
        outputs = self.core.commit_step(slot.plan, sampled)  # overlaps the forward of `queued`
        if queued is not None:
            queued.set_prep(self.core.prepare_sampling(queued.plan))  # needs `slot` committed
        return outputs

    def _fail(self, queued: StepSlot | None, error: BaseException) -> None:
        if queued is not None:
            queued.set_prep_error(error)  # never leave the device thread waiting
        self._inflight = None

    def _after_commit(self, queued: StepSlot | None) -> None:
        core = self.core
        if queued is None and core.kv_offload is not None:  # [kv-tiers hook] idle: write behind now
            core.kv_offload.submit_idle_device_io(self.executor)


class StepPipeline(_StepDriver):
    def step(self) -> list[RequestOutput]:
        """Commit the step in flight (having queued the next one first); [] when idle."""
        slot, queued = self._queue_next(None)
        if slot is None:
            return []
        try:
            outputs = self._commit(slot, queued, slot.result())
        except BaseException as e:
            self._fail(queued, e)
            raise
        self._after_commit(queued)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight without scheduling another (before shutdown)."""
        slot, self._inflight = self._inflight, None
        return [] if slot is None else self.core.commit_step(slot.plan, slot.result())


class AsyncStepPipeline(_StepDriver):
    """``StepPipeline`` for asyncio: identical order, awaiting the device thread instead of
    blocking, so the event loop keeps serving (HTTP, add_request, abort) during forwards."""

    async def step(self) -> list[RequestOutput]:
        slot, queued = self._queue_next(asyncio.get_running_loop())
        if slot is None:
            return []
        try:
            outputs = self._commit(slot, queued, await slot.wait())
        except BaseException as e:
            self._fail(queued, e)
            raise
        self._after_commit(queued)
        return outputs

    async def drain(self) -> list[RequestOutput]:
        slot, self._inflight = self._inflight, None
        return [] if slot is None else self.core.commit_step(slot.plan, await slot.wait())
