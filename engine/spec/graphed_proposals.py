"""CUDA graphs of the drafter's proposal pass, one per padded request count.

The pass (context ring read + ``DraftModel.propose``: two DSpark stages, the Markov chain, the
confidences) is a few hundred small kernels for any batch; run eagerly its launches, not its
arithmetic, set its time on a GPU. Here it is captured once per *bucket* of request counts
(1, 2, 4, .. up to the engine's slots) and replayed:

    inputs   [3, bucket] int64 on the device: y, anchors, slots (rows past N repeat row 0: a real
             request's context, so the padding computes ordinary numbers that are dropped)
    outputs  the captured ``Drafts`` ([bucket, K] each), read (first N rows) before the next call

As with the target's graphs (engine/core/cuda_graphs.py): a bucket's first sighting runs eagerly
on the padded inputs (it compiles the Triton kernels of those shapes), the second captures, then
every call replays. The ring and the weights are tensors the graph reads in place; the ring is
written between passes (``ContextRing.write``, in place), so a replay sees the current context.
A bucket whose capture fails runs eagerly from then on, logged once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from deepinfer.engine.spec.draft_model import Drafts

log = logging.getLogger(__name__)


def bucket(num_requests: int, max_requests: int) -> int:
    """The padded request count: the next power of two, at most ``max(max_requests, num_requests)``."""
    if num_requests < 1:
        raise ValueError(f"a proposal pass needs >= 1 request, got {num_requests}")
    b = 1 << (num_requests - 1).bit_length()
    return max(num_requests, min(b, max_requests))


def padded(values: list[int], size: int) -> list[int]:
    """``values`` padded to ``size`` with copies of its first element."""
    return values + [values[0]] * (size - len(values))


@dataclasses.dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, bucket] int64
    output: Drafts


@dataclasses.dataclass(slots=True)
class ProposalGraphStats:
    replays: int = 0
    captures: int = 0
    eager: int = 0
    failed: int = 0


class GraphedProposals:
    """``__call__(y, anchors, slots)`` = ``run(y_t, anchors_t, slots_t)`` for N host lists, from a
    CUDA graph of the padded bucket when one is captured (module docstring)."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Drafts], device: torch.device, *,
                 max_requests: int) -> None:
        """``run(y [B], anchors [B], slots [B])`` -> Drafts ``[B, K]``: the pass, device tensors in."""
        self._run = run
        self.device = torch.device(device)
        self.max_requests = max_requests
        self.stats = ProposalGraphStats()
        self._graphs: dict[int, _Entry] = {}
        self._seen: set[int] = set()
        self._failed: set[int] = set()
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(self.device)

    @torch.inference_mode()
    def __call__(self, y: list[int], anchors: list[int], slots: list[int]) -> Drafts:
        n = len(y)
        size = bucket(n, self.max_requests)
        host = torch.tensor([padded(y, size), padded(anchors, size), padded(slots, size)], dtype=torch.int64)
        entry = self._graphs.get(size)
        if entry is not None:
            entry.inputs.copy_(host)
            entry.graph.replay()
            self.stats.replays += 1
            return Drafts(*(t[:n] for t in entry.output))
        inputs = host.to(self.device)
        out = self._run(inputs[0], inputs[1], inputs[2])
        self.stats.eager += 1
        if size in self._seen and size not in self._failed:
            self._capture(size, inputs)  # the graph's own input buffer from now on
        self._seen.add(size)
        return Drafts(*(t[:n] for t in out))

    def _capture(self, size: int, inputs: torch.Tensor) -> None:
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                output = self._run(inputs[0], inputs[1], inputs[2])
        except RuntimeError as exc:  # an op of the pass that waits on the host
            del graph
            self._failed.add(size)
            self.stats.failed += 1
            torch.cuda.synchronize(self.device)
            log.warning("drafter pass of %d requests not captured as a CUDA graph, running it eagerly: %s", size,
                        str(exc).splitlines()[0], exc_info=log.isEnabledFor(logging.DEBUG))
            return
        current.wait_stream(self._stream)
        self._graphs[size] = _Entry(graph, inputs, Drafts(*output))
        self.stats.captures += 1
