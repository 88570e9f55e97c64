"""One rank's expert weights for one MoE layer: its physical slots, and the grouped compute.

    gate_up [S, 2I, H], down [S, H, I]: slot s holds logical expert phy2log[rank * S + s]

A re-placement fills a spare pair of the same shape in the background (``SparePool``) and
``swap`` puts it in service between two steps; the old pair goes back to the pool. On the CPU the
fixed-order native GEMMs compute each row alone (``kernels/cpu_gemm.moe_experts``), so a pair's
output is bitwise the single-process MoE's whichever rank and slot compute it; elsewhere the
torch path runs each slot's rows as the single-process MoE runs an expert's (``ops.linear`` with
its batch-invariant row padding).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from deepinfer.kernels import cpu_gemm, cpu_native, ops


class ExpertSlots:
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, limit: float):
        assert gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
        self.gate_up, self.down = gate_up, down
        self.limit = limit
        prepare(gate_up, down)

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]

    def swap(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Serve from (gate_up, down) from now on; returns the pair that served until now."""
        assert gate_up.shape == self.gate_up.shape and down.shape == self.down.shape
        old = self.gate_up, self.down
        self.gate_up, self.down = gate_up, down
        return old

    def compute(self, x: torch.Tensor, pair_row: torch.Tensor, pair_slot: np.ndarray, batch_invariant: bool):
        """Output rows [pairs, H] of pairs (row ``pair_row[i]`` of ``x`` through slot
        ``pair_slot[i]``), in pair order."""
        num_pairs = pair_slot.shape[0]
        if num_pairs == 0:
            return x.new_empty(0, x.shape[1])
        order = np.argsort(pair_slot, kind="stable")
        counts = np.bincount(pair_slot, minlength=self.num_slots)
        ends = np.cumsum(counts)
        segments = [(s, int(ends[s] - counts[s]), int(ends[s])) for s in np.flatnonzero(counts).tolist()]
        order_t = torch.from_numpy(order).to(x.device)
        token_of_row = pair_row.index_select(0, order_t)
        rows = cpu_gemm.moe_experts(x, token_of_row, segments, self.gate_up, self.down, self.limit)
        if rows is None:
            rows = self._torch_compute(x, token_of_row, segments, batch_invariant)
        out = torch.empty_like(rows)
        out.index_copy_(0, order_t, rows)  # back from slot order to pair order
        return out

    def _torch_compute(self, x, token_of_row, segments, batch_invariant):
        gathered = x.index_select(0, token_of_row)
        out = torch.empty_like(gathered)
        for s, first, end in segments:
            hidden = ops.linear(gathered[first:end], self.gate_up[s], batch_invariant)
            act = ops.swiglu_clamped(hidden, self.limit, batch_invariant)
            out[first:end] = ops.linear(act, self.down[s], batch_invariant)
        return out


def prepare(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Build what the first step on these weights would otherwise build (the CPU GEMM panels),
    so a swap costs the step loop nothing."""
    lib = cpu_native.library() if cpu_gemm.usable(gate_up, down) else None
    if lib is not None:
        cpu_gemm.packed(gate_up, lib)
        cpu_gemm.packed(down, lib)


class SparePool:
    """Spare (gate_up, down) pairs shared by a model's layers: a re-placement takes one, fills
    it, and gets the swapped-out pair back for the next layer. ``take`` blocks until one is free
    or the pool closes (then it returns None)."""

    def __init__(self, like_gate_up: torch.Tensor, like_down: torch.Tensor, count: int):
        assert count >= 1, "a re-placement needs at least one spare buffer"
        # zeroed and packed now, at start-up: a re-placement then writes into memory that is
        # already mapped (and re-packs into panels that exist) instead of faulting in a layer's
        # slots page by page beside the step loop, which slowed the steps of a process's first
        # re-placement on the CPU
        self._free = [(torch.zeros_like(like_gate_up), torch.zeros_like(like_down)) for _ in range(count)]
        for pair in self._free:
            prepare(*pair)
        self._cond = threading.Condition()
        self._closed = False

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._closed)
            return None if self._closed else self._free.pop()

    def give(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._cond:
            self._free.append(pair)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
