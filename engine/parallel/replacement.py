"""Re-placement of experts without stalling the step loop.

    step loop (every rank)                         background thread (every rank)
    ---------------------------------------        -------------------------------------------
    due: snapshot the window, start  ------------> sum the window over the group     (side)
                                                   rank 0 plans; broadcast phy2log   (side)
    each step boundary:                            for each layer whose row changed:
      n = min over ranks of layers staged            take a spare buffer (waits for a swap)
      swap layers [swapped, n): weights + maps       local copies + all-to-all of weights (side)
      give each old buffer back to the pool          pack CPU GEMM panels; staged += 1

Layers swap one by one at step boundaries, on every rank at the same step (the agreement is one
small all-reduce per step while a re-placement is in flight), so a token is never dispatched by
one map to weights of another. With one spare buffer a layer is staged while the previous one
waits for its swap: memory for one layer's slots, not a second copy of the model's experts.

A failure anywhere (a dead peer, a planner error) is reported to every rank at the next
agreement as ``ReplacementError``; the step loop decides what to do (the weights in service are
untouched).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.engine.parallel.eplb import check_placement
from deepinfer.engine.parallel.eplb.schedule import window_imbalance
from deepinfer.engine.parallel.eplb.planner import MAX_HISTORY_STEPS
from deepinfer.engine.parallel.eplb.transfers import SlotSources, slot_sources
from deepinfer.engine.parallel.expert_slots import SparePool, prepare
from deepinfer.engine.parallel.group import EpGroup
from deepinfer.engine.parallel.layer_placement import LayerPlacement

NOT_PLANNED = -1  # this rank's plan has not arrived yet
CHUNK_SLOTS = 1  # expert slots per peer in one background all-to-all (a V4-Flash slot: 25 M weights)
FAILED = -(1 << 40)  # this rank's re-placement failed (FAILED + rank: the lowest failed rank wins the min)


class ReplacementError(RuntimeError):
    """A re-placement failed on some rank; the weights in service are unchanged."""


class Replacement:
    """One re-placement in flight (built by ``ExpertParallel`` when the schedule says so)."""

    def __init__(self, ep: EpGroup, layers: list, pool: SparePool, planner: Callable[..., np.ndarray],
                 num_logical: int, nice: int = 19, duty: float = 1.0, cpus: tuple[int, ...] = ()):
        self.ep, self.layers, self.pool, self.planner = ep, layers, pool, planner
        self.num_logical, self.nice, self.duty, self.cpus = num_logical, nice, duty, tuple(cpus)
        self._lock = threading.Lock()
        self._staged: list[tuple[int, np.ndarray, tuple[torch.Tensor, torch.Tensor]]] = []
        self._num_changed: int | None = None
        self._error: BaseException | None = None
        self.num_swapped = 0
        self.swap_work_s = 0.0  # the longest a step boundary spent putting layers in service (after agreeing)
        self._all_planned = False  # an agreement has seen the plan on every rank
        self.num_remote_slots = 0  # slots whose weights came from another rank
        self.phy2log: np.ndarray | None = None  # the plan, once broadcast
        self.planned_imbalance = 0.0  # the group's window under the plan (the drift trigger's base)
        self._thread: threading.Thread | None = None
        # (phase, layer, start, end) of the background work on the perf_counter clock: what a
        # step-time measurement sets next to its steps (-1: no layer)
        self.timeline: list[tuple[str, int, float, float]] = []

    def start(self, total: np.ndarray, history: np.ndarray | None, current: np.ndarray) -> None:
        """total: [layers, E] this rank's window; history: [T, layers, E] or None; current:
        [layers, P] the placement in service."""
        args = (np.asarray(total, dtype=np.float64), None if history is None else _bucket(history), current.copy())
        self._thread = threading.Thread(target=self._run, args=args, name="ep-replacement", daemon=True)
        self._thread.start()

    # ---- background ----------------------------------------------------------------------------
    def _run(self, total, history, current) -> None:
        _lower_priority(self.nice)  # on a shared CPU the step loop's threads come first
        pin_thread(self.cpus)
        try:
            with torch.no_grad():
                started = time.perf_counter()
                new = self._plan(total, history, current)
                self.timeline.append(("plan", -1, started, time.perf_counter()))
                self._pace(started)  # the first copy no sooner than the duty allows: not in the plan's step
                changed = [layer for layer in range(current.shape[0]) if not np.array_equal(new[layer], current[layer])]
                with self._lock:
                    self.phy2log = new
                    self._num_changed = len(changed)
                for layer in changed:
                    started = time.perf_counter()
                    buffers = self.pool.take()
                    if buffers is None:  # shutting down
                        return
                    self.timeline.append(("wait", layer, started, time.perf_counter()))
                    sources = slot_sources(current[layer], new[layer], self.ep.size)
                    self._stage(layer, self.layers[layer].slots, sources, buffers)
                    with self._lock:
                        self.num_remote_slots += sources.num_remote
                        self._staged.append((layer, new[layer], buffers))
        except BaseException as exc:  # reported to every rank at the next agreement
            with self._lock:
                self._error = exc

    def _plan(self, total, history, current) -> np.ndarray:
        ep = self.ep
        total_t = ep.side_sum(torch.from_numpy(total))
        history_t = None if history is None else ep.side_sum(torch.from_numpy(history))
        new = torch.empty(current.shape, dtype=torch.long)
        if ep.rank == 0:
            plan = self.planner(total_t.numpy(), current.shape[1], ep.size,
                                history=None if history_t is None else history_t.numpy(), current=current)
            check_placement(plan, self.num_logical, ep.size)
            new.copy_(torch.from_numpy(np.asarray(plan, dtype=np.int64)))
        ep.side_broadcast(new, src=0)
        self.planned_imbalance = window_imbalance(total_t.numpy(), new.numpy(), ep.size)
        return new.numpy()

    def _stage(self, layer: int, slots, sources: SlotSources, buffers) -> None:
        """Fill ``buffers`` with the new slots of this rank: local copies, then all-to-alls of
        ``CHUNK_SLOTS`` slots per peer at a time. Each piece is one short burst of memory and
        socket traffic with a yield after it, so the step loop (and the gloo threads it waits
        on) never queue behind a whole layer's copy."""
        ep, me = self.ep, self.ep.rank
        started = time.perf_counter()
        gate_up, down = buffers
        for j in np.flatnonzero(sources.src_rank[me] == me).tolist():
            piece = time.perf_counter()
            src = int(sources.src_slot[me, j])
            gate_up[j].copy_(slots.gate_up[src])
            down[j].copy_(slots.down[src])
            self._pace(piece)  # let the step loop take the GIL (and the memory bus)
        self.timeline.append(("copy", layer, started, time.perf_counter()))
        if ep.size > 1:
            started = time.perf_counter()
            sends = [sources.sends(me, r) if r != me else (np.empty(0, np.int64),) * 2 for r in range(ep.size)]
            recvs = [sources.sends(q, me) if q != me else (np.empty(0, np.int64),) * 2 for q in range(ep.size)]
            # the same count on every rank: the table is the same everywhere
            most = max(len(sources.sends(q, r)[0]) for q in range(ep.size) for r in range(ep.size) if q != r)
            for first in range(0, most, CHUNK_SLOTS):
                piece = time.perf_counter()
                part = slice(first, first + CHUNK_SLOTS)
                self._exchange(slots, gate_up, down, [s[part] for s, _ in sends], [d[part] for _, d in recvs])
                self._pace(piece)
            self.timeline.append(("send", layer, started, time.perf_counter()))
        started = time.perf_counter()
        prepare(gate_up, down)
        self.timeline.append(("pack", layer, started, time.perf_counter()))
        self._pace(started)

    def _pace(self, started: float) -> None:
        """After a piece of background work that began at ``started``: pause so the thread works
        ``duty`` of the wall time (always yield the GIL once)."""
        busy = time.perf_counter() - started
        time.sleep(busy * (1.0 / self.duty - 1.0) if self.duty < 1.0 else 0.0)

    def _exchange(self, slots, gate_up, down, out_slots: list[np.ndarray], in_slots: list[np.ndarray]) -> None:
        """One side all-to-all: ``out_slots[r]`` (local old slots) go to rank r, rank q's rows land
        in the new slots ``in_slots[q]``."""
        split = gate_up[0].numel()
        width = split + down[0].numel()
        out = np.concatenate(out_slots)
        send = torch.cat([slots.gate_up[out].reshape(len(out), split),
                          slots.down[out].reshape(len(out), width - split)], dim=1).cpu()
        into = np.concatenate(in_slots)
        recv = torch.empty(len(into), width, dtype=send.dtype)
        self.ep.side_all_to_all(recv.view(-1), send.reshape(-1), [len(d) * width for d in in_slots],
                                [len(s) * width for s in out_slots])
        if len(into):
            index = torch.from_numpy(into).to(gate_up.device)
            gate_up.index_copy_(0, index, recv[:, :split].reshape(-1, *gate_up.shape[1:]).to(gate_up.device))
            down.index_copy_(0, index, recv[:, split:].reshape(-1, *down.shape[1:]).to(down.device))

    # ---- the step loop's side -----------------------------------------------------------------------
    @property
    def num_staged(self) -> int:
        """Layers this rank has staged so far (swapped or not)."""
        with self._lock:
            return len(self._staged)

    @property
    def is_done(self) -> bool:
        """Every changed layer swapped in, as agreed by the group (the same answer on every rank)."""
        return self._all_planned and self.num_swapped == self._num_changed

    def swap_ready(self) -> int:
        """At a step boundary, on every rank: agree how many layers every rank has staged and put
        those in service. Returns the layers swapped now."""
        with self._lock:
            if self._error is not None:
                mine = FAILED + self.ep.rank
            elif self._num_changed is None:
                mine = NOT_PLANNED
            else:
                mine = len(self._staged)
        agreed = int(self.ep.agree_min(torch.tensor([mine], dtype=torch.long)).item())
        if agreed <= FAILED // 2:
            self.pool.close()
            failed = agreed - FAILED
            why = f": {self._error!r}" if self._error is not None else ""
            raise ReplacementError(f"the expert re-placement failed on EP rank {failed}{why}; "
                                   "the placement in service is unchanged")
        self._all_planned = agreed >= 0
        started = time.perf_counter()
        with self._lock:
            ready = self._staged[self.num_swapped : max(agreed, self.num_swapped)]
        swapped = 0
        for layer, row, buffers in ready:
            ep_layer = self.layers[layer]
            old = ep_layer.slots.swap(*buffers)
            ep_layer.placement = LayerPlacement.of(row, self.num_logical, self.ep.size)
            self.pool.give(old)
            swapped += 1
        self.num_swapped += swapped
        if swapped:
            self.swap_work_s = max(self.swap_work_s, time.perf_counter() - started)
        return swapped

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _lower_priority(nice: int) -> None:
    """Nice this thread (Linux sets priorities per thread): at 19 staging competes only for the
    CPU the step loop leaves idle. Elsewhere a no-op."""
    if not nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def pin_thread(cpus: tuple[int, ...]) -> None:
    """Run the calling thread on ``cpus`` (Linux affinity is per thread); empty: unchanged."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise ValueError(f"EP background_cpus {sorted(cpus)}: the staging thread cannot run there ({exc})") from exc


def _bucket(history: np.ndarray) -> np.ndarray:
    """[T, ...] -> at most MAX_HISTORY_STEPS buckets of adjacent steps summed (the planner's own
    resolution), so the group sums less."""
    history = np.asarray(history, dtype=np.float64)
    if history.shape[0] <= MAX_HISTORY_STEPS:
        return history
    edges = np.linspace(0, history.shape[0], MAX_HISTORY_STEPS + 1).astype(np.int64)
    return np.add.reduceat(history, edges[:-1], axis=0)
