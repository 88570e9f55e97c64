"""The device thread's side of step overlap: handed-over steps run back to back on one executor.

The caller's thread hands each scheduled step over as a ``StepSlot`` (``DeviceChain.submit``)
while the previous step's forward still runs. One executor job (the *chain*) takes slots in
order and, per slot: forward, wait for the caller's sampling inputs, sample; then, if the next
slot is already handed over, writes this step's tokens into that slot's placeholders *before*
publishing this step's result, so the next forward starts with no caller wake-up, Future or
executor round trip in between (ARCHITECTURE.md, "The step timeline", draws both threads).

When no slot is waiting the chain publishes, waits up to ``LINGER_S`` for a late hand-over,
then ends; the next ``submit`` starts a new job on the same executor, so other device jobs
(KV-tier copies, a no-op used to wait for the device) still run in submission order between
chains. Publishing releases a plain lock (and, for asyncio callers, schedules a wake-up on
their loop); plain locks cost a few microseconds where a ``concurrent.futures.Future`` round
trip costs ~0.1 ms of the device thread's time.

A slot whose predecessor failed fails with the same error without running (its placeholders
would be unknown); a failure in the caller's bookkeeping reaches the device thread through
``set_prep_error`` so it never waits forever.

Device-fed ids (``feed_ids``; on by default when the logits live on an accelerator): when the
next slot is a decode batch whose placeholders all resolve to rows of this step's plain tokens,
its forward is launched right after this step's sampling is queued, taking those tokens from the
device (``ForwardBatch.token_source``), before the host has read them. The device then runs the
two forwards back to back while the host reads this step's tokens (a copy queued behind the
sampling, sampler.py), fills the placeholders for the bookkeeping and publishes; the next
slot's sampling waits for its caller's prep as before. On a CPU the "device" is this thread, so
launching early would only delay the publication: off there unless asked for (tests).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Executor

from deepinfer import envs
from deepinfer.engine.core.batch import TokenSource
from deepinfer.engine.core.engine_core import EngineCore, PlaceholderRows, SampledStep, SamplingPrep, StepPlan

# How long a chain whose next step is not handed over yet waits for it before ending its job
# (other jobs on the executor wait at most this long behind it).
LINGER_S = 0.002


class StepSlot:
    """One step between the caller's thread and the device thread."""

    __slots__ = ("plan", "prev", "rows", "_prep", "_prep_error", "_prep_ready", "sampled", "error", "_done",
                 "_is_published", "_loop", "_waiter", "launched")

    def __init__(self, plan: StepPlan, prev: StepSlot | None, rows: PlaceholderRows | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.plan = plan
        self.prev = prev  # the step whose tokens fill this one's placeholders (None: none)
        self.rows = rows  # placeholder -> row of prev's tokens, resolved by the caller
        self._prep: SamplingPrep | None = None
        self._prep_error: BaseException | None = None
        self._prep_ready = threading.Lock()
        self._prep_ready.acquire()
        self.sampled: SampledStep | None = None
        self.error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()
        self._is_published = False
        self._loop = loop
        self._waiter: asyncio.Future | None = loop.create_future() if loop is not None else None
        self.launched = None  # device thread: the logits of a forward launched on device-fed ids

    # ---- caller's thread ----------------------------------------------------------------
    @property
    def prep(self) -> SamplingPrep | None:
        """The sampling inputs the caller set (None until then)."""
        return self._prep

    def set_prep(self, prep: SamplingPrep) -> None:
        self._prep = prep
        self._prep_ready.release()

    def set_prep_error(self, error: BaseException) -> None:
        if self._prep is None and self._prep_error is None:
            self._prep_error = error
            self._prep_ready.release()

    def result(self) -> SampledStep:
        """Block until the device thread published this step; its tokens or its error."""
        self._done.acquire()
        self._done.release()  # a second reader (drain after a failed step) must not block
        return self._outcome()

    async def wait(self) -> SampledStep:
        """``result`` for asyncio callers (the slot was built with their loop)."""
        await self._waiter
        return self._outcome()

    def _outcome(self) -> SampledStep:
        if self.error is not None:
            raise self.error
        return self.sampled

    # ---- device thread ------------------------------------------------------------------
    def take_prep(self) -> SamplingPrep:
        self._prep_ready.acquire()
        self._prep_ready.release()
        if self._prep_error is not None:
            raise self._prep_error
        return self._prep

    def publish(self) -> None:
        if self._is_published:
            return
        self._is_published = True
        self._done.release()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed while this step ran: nobody is waiting
                pass

    def _wake(self) -> None:
        if not self._waiter.done():
            self._waiter.set_result(None)


class DeviceChain:
    """Runs handed-over ``StepSlot``s in order on ``executor`` (one thread), chaining them."""

    def __init__(self, core: EngineCore, executor: Executor, *, feed_ids: bool | None = None) -> None:
        """``feed_ids``: device-fed ids (module docstring); None: on unless the logits live on the
        CPU or ``DEEPINFER_FEED_IDS=0``."""
        self.core = core
        self.executor = executor
        if feed_ids is None:
            feed_ids = core.config.device != "cpu" and envs.get().feed_ids
        self.feed_ids = feed_ids
        self.num_fed = 0  # forwards launched on device-fed ids
        self._lock = threading.Lock()
        self._handed_over = threading.Condition(self._lock)
        self._pending: deque[StepSlot] = deque()
        self._is_running = False

    def submit(self, slot: StepSlot) -> None:
        with self._lock:
            self._pending.append(slot)
            if self._is_running:
                self._handed_over.notify()  # (a chain lingering for a late hand-over)
                return  # the running chain takes it after the slot in front of it
            self._is_running = True
        try:
            self.executor.submit(self._run)
        except BaseException as e:  # executor shut down: fail the slot instead of hanging
            self._fail_all(None, e)
            raise

    def _fail_all(self, current: StepSlot | None, error: BaseException) -> None:
        """End the chain, failing ``current`` (unless published) and every slot handed over."""
        with self._lock:
            self._is_running = False
            stranded = list(self._pending)
            self._pending.clear()
        for s in ([current] if current is not None else []) + stranded:
            if s.error is None and s.sampled is None:
                s.error = error
            s.publish()

    def _take(self, linger_s: float = 0.0) -> StepSlot | None:
        """The next slot handed over, waiting up to ``linger_s`` for it; None ends the chain."""
        with self._lock:
            if not self._pending and linger_s > 0:
                self._handed_over.wait(linger_s)
            if self._pending:
                return self._pending.popleft()
            self._is_running = False
            return None

    def _peek_take(self) -> StepSlot | None:
        """The next slot if it is already handed over (the chain goes on either way)."""
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def _run(self) -> None:
        """The chain: one executor job for as many steps as are handed over in time."""
        slot = None
        try:
            slot = self._take()
            if slot is not None:
                self._fill(slot)  # a chain's first slot: its predecessor ran in an earlier job
            while slot is not None:
                slot = self._run_one(slot)
        except BaseException as e:  # a bug here must never leave a caller waiting forever
            self._fail_all(slot, e)
            raise

    def _run_one(self, slot: StepSlot) -> StepSlot | None:
        """Forward and sample ``slot``, fill the next one, publish; returns the next one."""
        core = self.core
        if slot.error is None:
            try:
                logits, slot.launched = slot.launched, None
                if logits is None:
                    logits = core.execute(slot.plan)
                slot.sampled = core.run_sampling(slot.take_prep(), logits, slot.plan)
            except BaseException as e:
                slot.error = e
        nxt = self._peek_take()
        if nxt is not None:
            if self.feed_ids:
                self._launch_fed(slot, nxt)
            self._fill(nxt)  # before publishing: nothing stands between the two forwards
            slot.publish()
        else:
            # The caller is late (busy machine) or idle: publish, then wait a little for
            # the next step here rather than ending the job (a new job costs the device
            # thread ~0.1 ms of executor and Future bookkeeping).
            slot.publish()
            nxt = self._take(LINGER_S)
            if nxt is not None:
                self._fill(nxt)
        return nxt

    def _launch_fed(self, slot: StepSlot, nxt: StepSlot) -> None:
        """Launch ``nxt``'s forward on ``slot``'s device tokens when ``nxt`` is a decode batch
        whose placeholders all map to rows of them; otherwise leave it to run after ``_fill``."""
        sampled, rows = slot.sampled, nxt.rows
        if (slot.error is not None or nxt.error is not None or nxt.prev is not slot or sampled is None
                or sampled.device_tokens is None or rows is None or rows.source is not sampled.plain_ids):
            return
        batch = nxt.plan.batch
        step_of = {}
        for k, s in enumerate(batch.steps):
            if len(s.token_ids) != 1:
                return  # a prefill chunk or a verification in the batch: fill on the host
            step_of[id(s.token_ids)] = k
        dst, index = [], []
        for ids, pos, row in rows.targets:
            k = step_of.get(id(ids))
            if k is None:
                return
            ids[pos] = 0  # any valid id: the device writes the sampled one over it
            dst.append(k)
            index.append(row)
        batch.token_source = TokenSource(sampled.device_tokens, dst, index)
        try:
            nxt.launched = self.core.execute(nxt.plan)
            self.num_fed += 1
        except BaseException as e:
            nxt.error = e

    def _fill(self, slot: StepSlot) -> None:
        prev, slot.prev = slot.prev, None  # dropped: a slot must not keep the whole history alive
        if prev is None:
            return
        if prev.error is not None:
            slot.error = prev.error  # its placeholders stand for tokens that never came
            return
        try:
            self.core.fill_placeholders(slot.plan, prev.sampled, slot.rows)
        except BaseException as e:
            slot.error = e
