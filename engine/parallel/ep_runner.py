"""The model runner of one EP rank: every forward is a step of the whole group.

The MoE layers' exchanges need every rank of the group in every step, but each rank schedules
its own requests (attention is data-parallel). ``EpRunner`` keeps the ranks in lockstep without
anyone waiting for work that is not there:

    every round, on every rank:   any = max over ranks of "I have a forward to run"
        any == 0: nobody has work; wait a little, ask again (idle poll, off the step path)
        any == 1: a step: ExpertParallel.begin_step(); then this rank's forward if it has one,
                  else ExpertParallel.idle_step() (its experts serve the others' tokens)

The device thread asks with 1 from ``execute``; a poll thread asks with 0 while the device thread
has nothing, so a rank with no requests still serves its experts. One lock keeps the two from
issuing collectives at once; the order of rounds is the same on every rank. A closing rank goes
on serving the others' steps from its poll thread until every rank is closing: that round is the
last on every rank, so nobody leaves a peer waiting in a collective.

A dead peer is an error within the group's timeout, never a hang: the failing collective raises,
the runner is broken from then on (``EpGroupError`` from every call, at once), and the engine's
step loop fails the step's requests. Restarting the group is the launcher's job
(``runtime/ep/engine_group.py``): a broken group does not heal.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from deepinfer.engine.parallel.expert_parallel import ExpertParallel
from deepinfer.engine.parallel.group import EpGroupError

log = logging.getLogger(__name__)

POLL_S = 0.001  # idle polls while recently busy
SLOW_POLL_S = 0.02  # after IDLE_SLOWDOWN_S without work anywhere
IDLE_SLOWDOWN_S = 1.0


class EpRunner:
    """Wraps a ``ModelRunner`` whose model ``ExpertParallel`` has sharded; the rest of the runner's
    interface (KV layout, blocks, slots) passes through."""

    def __init__(self, runner, parallel: ExpertParallel, timeout_s: float = 30.0, *, owns_group: bool = False):
        self._runner = runner
        self.ep_timeout_s = timeout_s
        self._owns_group = owns_group  # close() leaves torch.distributed too (one group per process)
        self.parallel = parallel
        self.ep = parallel.ep
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._closed = threading.Event()
        self.num_steps = self.num_idle_steps = 0
        self._poller = threading.Thread(target=self._poll, name=f"ep-rank{self.ep.rank}-idle", daemon=True)
        self._poller.start()

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def ep_stats(self) -> dict[str, float]:
        """``ExpertParallel.stats()``, the group's size and whether it broke (EngineStats.ep)."""
        return {**self.parallel.stats(), "size": float(self.ep.size), "broken": float(self._broken is not None)}

    # ---- the device thread --------------------------------------------------------------------
    def execute(self, batch) -> torch.Tensor:
        return self._step(self._runner.execute, batch)

    def execute_hidden(self, batch) -> torch.Tensor:
        return self._step(self._runner.execute_hidden, batch)

    def _step(self, forward, batch):
        with self._lock:
            self._check()
            try:
                self._agree(1)
                self.parallel.begin_step()
                out = forward(batch)
            except EpGroupError:
                raise
            except RuntimeError as exc:  # a collective failed: a peer died or timed out
                raise self._break(exc) from exc
            self.num_steps += 1
            return out

    # ---- the poll thread ------------------------------------------------------------------------
    def _poll(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._broken is not None:
                    return
                try:
                    any_work, all_closing = self._agree(0, self._closed.is_set())
                    if all_closing:  # every rank is closing: no round after this one
                        return
                    stepped = any_work
                    if stepped:
                        self.parallel.begin_step()
                        with torch.inference_mode():
                            self.parallel.idle_step()
                        self.num_idle_steps += 1
                except Exception as exc:  # noqa: BLE001 - any failure breaks the group
                    self._break(exc)
                    return
            now = time.monotonic()
            if stepped:
                idle_since = now
                continue  # others are stepping: straight to the next round
            self._closed.wait(POLL_S if now - idle_since < IDLE_SLOWDOWN_S else SLOW_POLL_S)

    # ---- shared ----------------------------------------------------------------------------------
    def _agree(self, has_work: int, is_closing: bool = False) -> tuple[bool, bool]:
        """One round: (does any rank have a forward, is every rank closing). One all-reduce of
        [has_work, -is_closing] under MAX: the second is minus the minimum of the closing flags."""
        flags = self.ep.agree_max(torch.tensor([has_work, -int(is_closing)], dtype=torch.int64)).tolist()
        return bool(flags[0]), flags[1] == -1

    def _check(self) -> None:
        if self._broken is not None:
            raise EpGroupError(self._broken)
        if self._closed.is_set():
            raise EpGroupError(f"EP rank {self.ep.rank}: the runner is closed")

    def _break(self, exc: BaseException) -> EpGroupError:
        if self._broken is None:
            self._broken = (f"EP rank {self.ep.rank} of {self.ep.size} lost the group ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); the group must restart")
            log.error("%s", self._broken)
        return EpGroupError(self._broken)

    @property
    def is_broken(self) -> bool:
        return self._broken is not None

    @property
    def broken_reason(self) -> str | None:
        return self._broken

    def close(self) -> None:
        """Leave the group cleanly: returns once every rank has closed (the round that sees them all
        closing is the last anywhere); a rank that never closes: the group's timeout ends it."""
        self._closed.set()
        self._poller.join(timeout=self.ep_timeout_s + 1.0)
        self.parallel.close()
        if self._owns_group:
            self.ep.close()
