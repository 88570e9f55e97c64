"""After each target step, on the device thread: feed the drafter's context, propose drafts.

For every sequence of the step (its SeqStep covers positions ``[start, start + n)``):

    accepted positions   all n for a step without sample rows (a middle prefill chunk);
                         n - rejected for one with them, rejected = sample rows - tokens accepted
    context ring         the injected rows of the last ``window`` accepted positions
    proposal             sequences with sample rows: anchor = the last accepted position,
                         y = the last accepted token (it sits at anchor + 1), K drafts after it

All proposals of a step run as one batch through the ``DraftModel``. A request that finished or
was aborted while the step ran has no accepted tokens in the step's result: it is skipped.

Threads: the pass (context rows and drafts) runs with the intra-op thread count the SPS
calibration found fastest for a batch of that size (``SpsTable.draft_threads``,
sps_calibration.py), then the count is set back. A pass over a few requests is a few hundred
tiny ops; splitting each over the cores gains little and stalls at every op when another job
holds the second core (2-core CPU here, one request: 5.7 ms with 1 thread, 6.4 ms with 2 when
idle, 12 ms with 2 under load). With OpenMP the count is the calling thread's (the device
thread's), so the loop thread's work is not touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.spec.context_ring import ContextRing
from deepinfer.engine.spec.draft_model import DraftModel, Drafts
from deepinfer.engine.spec.graphed_proposals import GraphedProposals


@dataclass(slots=True)
class StepDrafts:
    """One step's proposals, on the host (the loop's thread reads them at commit)."""

    request_ids: list[str] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)  # last accepted position of each request
    tokens: list[list[int]] = field(default_factory=list)  # [N][K]
    confidence: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [N, K]
    seconds: float = 0.0  # the proposal's device time (context rows + drafts)

    def __len__(self) -> int:
        return len(self.request_ids)


@contextmanager
def intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Run the calling thread's torch ops with ``num_threads`` intra-op threads (None, 0 or the
    current count: unchanged), then restore the count."""
    current = torch.get_num_threads()
    if not num_threads or num_threads == current:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(current)


def threads_for(draft_threads: Mapping[int, int] | None, num_requests: int) -> int | None:
    """The thread count measured for the smallest grid request count >= ``num_requests`` (the
    largest past the grid); None without measurements."""
    if not draft_threads:
        return None
    grid = sorted(draft_threads)
    return draft_threads[next((r for r in grid if r >= num_requests), grid[-1])]


class DraftProposer:
    def __init__(self, model: DraftModel, num_slots: int, *, draft_threads: Mapping[int, int] | None = None,
                 cuda_graphs: bool = False) -> None:
        """``draft_threads``: request count -> intra-op threads for the pass (module docstring);
        ``cuda_graphs``: on a CUDA device, replay the pass from graphs per padded request count
        (graphed_proposals.py)."""
        self.model = model
        self.ring = ContextRing(num_stages=model.num_stages, num_slots=num_slots, window=model.window,
                                width=model.row_width, device=model.device, dtype=model.dtype)
        self.draft_threads = dict(draft_threads or {})
        self.graphs = None
        if cuda_graphs and torch.device(model.device).type == "cuda":
            self.graphs = GraphedProposals(self._pass, model.device, max_requests=num_slots)

    def _pass(self, y: torch.Tensor, anchors: torch.Tensor, slots: torch.Tensor) -> Drafts:
        """The proposal pass over device tensors ``[N]``: the ring's context, then the drafts."""
        ctx, valid = self.ring.read(slots, anchors)
        return self.model.propose(y, anchors, ctx, valid)

    def propose(self, scheduled, accepted: dict[str, list[int]], *, draft: bool = True) -> StepDrafts:
        """``scheduled``: the step's ScheduledSeqs in batch order; ``accepted``: request id ->
        the tokens the step committed (1 + accepted drafts) for those with sample rows.
        ``draft=False``: only the context ring is written (the drafter gate skipped this step)."""
        with intra_op_threads(threads_for(self.draft_threads, len(scheduled))):
            return self._propose(scheduled, accepted, draft)

    def _propose(self, scheduled, accepted: dict[str, list[int]], draft: bool) -> StepDrafts:
        captured = self.model.take_features()
        write_rows, write_pos, write_slots = [], [], []
        ids, anchors, ys, slots = [], [], [], []
        window = self.ring.window
        offset = 0
        for s in scheduled:
            step, first = s.step, offset
            offset += step.num_tokens
            num_valid = step.num_tokens
            if s.num_sample_rows:
                toks = accepted.get(s.request_id)
                if not toks:
                    continue  # finished or aborted while the step ran
                num_valid -= s.num_sample_rows - len(toks)
            self.ring.claim(step.slot, step.seq_id)
            keep = min(num_valid, window)
            lo = num_valid - keep
            write_rows.append(np.arange(first + lo, first + num_valid))
            write_pos.append(np.arange(step.start_pos + lo, step.start_pos + num_valid))
            write_slots.append(np.full(keep, step.slot))
            if s.num_sample_rows and draft:
                ids.append(s.request_id)
                anchors.append(step.start_pos + num_valid - 1)
                ys.append(toks[-1])
                slots.append(step.slot)
        if captured is not None and write_rows:
            self._write(captured, offset, np.concatenate(write_rows), np.concatenate(write_pos),
                        np.concatenate(write_slots))
        out = StepDrafts(ids, anchors)
        if ids:
            if self.graphs is not None:
                drafts = self.graphs(ys, anchors, slots)
            else:
                dev = self.model.device
                drafts = self._pass(*(torch.tensor(v, dtype=torch.int64, device=dev) for v in (ys, anchors, slots)))
            out.tokens = drafts.tokens.tolist()
            out.confidence = drafts.confidence.float().cpu().numpy().astype(np.float64)
        return out

    def _write(self, captured, num_rows: int, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        feature_rows, features = captured
        if feature_rows is not None:  # only a sub-batch's rows have features
            where = np.full(num_rows, -1, dtype=np.int64)
            where[feature_rows.cpu().numpy()] = np.arange(feature_rows.numel())
            picked = where[rows]
            has = picked >= 0
            rows, positions, slots = picked[has], positions[has], slots[has]
        if rows.size == 0:
            return
        dev = features.device
        index = torch.from_numpy(rows).to(dev)
        pos = torch.from_numpy(positions).to(dev)
        ctx_rows = self.model.context_rows(features.index_select(0, index), pos)
        self.ring.write(torch.from_numpy(slots).to(dev), pos, ctx_rows)
