"""One expert-parallel group over torch.distributed: its ranks and the two channels it talks on.

    moe      the step's traffic, from the step loop's thread: per MoE layer a count exchange,
             the dispatch and the combine all-to-alls; between steps the small agreements
             (which staged layers swap in, which replica rule serves)
    side     the re-placement's traffic, from its background thread: statistics, the plan,
             expert weights

Two process groups so a background transfer never interleaves with a step's collectives (every
rank issues each group's operations in one order; the two orders are independent). Gloo on CPU;
on GPU the step's group is NCCL (``backend="nccl"``) and the side group stays gloo: weights
move through host memory there until a peer-copy path exists (the NCCL run is [ep-nccl]).

A dead peer is an error, never a hang: gloo fails an operation whose peer's connection closed,
and every operation is bounded by ``timeout_s``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class EpGroupError(RuntimeError):
    """The group could not form or lost a rank; the message says which and what to do."""


@dataclass(slots=True)
class EpGroup:
    rank: int  # this process's index in the group, 0 .. size - 1
    size: int
    moe: object  # the step's process group
    side: object  # the background process group
    device: torch.device

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, *, backend: str | None = None,
             device: str | torch.device = "cpu", timeout_s: float = 30.0,
             side_cpus: tuple[int, ...] = ()) -> "EpGroup":
        """Join a group of ``size`` processes as ``rank`` (``init_method`` e.g.
        ``tcp://127.0.0.1:PORT``); the whole world is the group. ``side_cpus``: the CPUs the side
        group's own threads (gloo's workers and socket loop, started with the group) may run on,
        the background CPUs of ``EpSettings``: re-placement traffic then never takes the step
        loop's core; empty: the calling thread's."""
        if not 0 <= rank < size:
            raise EpGroupError(f"rank {rank} is outside an EP group of {size}; give 0 <= rank < size")
        device = torch.device(device)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        except (RuntimeError, ValueError) as exc:
            raise EpGroupError(f"rank {rank} of {size} could not join the EP group at {init_method}: {exc}") from exc
        moe = dist.group.WORLD
        with threads_born_on(side_cpus):
            side = dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank, size, moe, side, device)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "EpGroup":
        """EP = 1 without torch.distributed: every exchange is a local copy."""
        return cls(0, 1, None, None, torch.device(device))

    @classmethod
    def split(cls, parent: "EpGroup", ranks_of_groups: list[list[int]]) -> "EpGroup":
        """Sub-groups of a running world (every world rank calls this with the same lists):
        this rank's group among ``ranks_of_groups``."""
        mine = None
        for ranks in ranks_of_groups:
            moe = dist.new_group(ranks=ranks)
            side = dist.new_group(ranks=ranks, backend="gloo")
            if parent.rank in ranks:
                mine = cls(ranks.index(parent.rank), len(ranks), moe, side, parent.device)
        if mine is None:
            raise EpGroupError(f"world rank {parent.rank} is in none of the groups {ranks_of_groups}")
        return mine

    # ---- the step's traffic ----------------------------------------------------------------------
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   *, async_op: bool = False):
        """Rows ``inp[sum(in_splits[:r]) ...]`` to rank r; ``out`` takes rank r's rows at
        ``sum(out_splits[:r])``. A work handle with ``async_op`` (wait() before reading ``out``)."""
        if self.size == 1:
            out.copy_(inp)
            return _Done() if async_op else None
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.moe, async_op=async_op)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [size, c] int64 (row r: what goes to rank r) -> [size, c] (row r: from rank r)."""
        if self.size == 1:
            return counts.clone()
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts, group=self.moe)
        return out

    def agree_min(self, value: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum over the group (between steps, on the step's channel)."""
        if self.size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.moe)
        return value

    def agree_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(value, group=self.moe)
        return value

    def agree_max(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.moe)
        return value

    # ---- the background traffic ------------------------------------------------------------------
    def side_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(value, group=self.side)
        return value

    def side_broadcast(self, value: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(value, src=self._world_rank(src, self.side), group=self.side)
        return value

    def side_all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                        in_splits: list[int]) -> None:
        if self.size == 1:
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.side)

    @staticmethod
    def _world_rank(group_rank: int, group) -> int:
        return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank

    def close(self) -> None:
        """Leave the group (the last call of a rank; safe after a peer died)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


@contextmanager
def threads_born_on(cpus: tuple[int, ...]):
    """Threads started inside the block (by native code too) may run on ``cpus`` only: a new
    thread takes its creator's affinity, so the calling thread runs there for the block and is
    put back after. Empty or where Linux affinity is missing: no change."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise EpGroupError(f"EP background_cpus {sorted(cpus)}: the side group's threads cannot run there ({exc})") from exc
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class _Done:
    """The work handle of an operation that finished at once (a group of one)."""

    def wait(self) -> bool:
        return True
