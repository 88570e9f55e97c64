"""Per-forward index metadata of a V4.1 model: V4's plans plus Engram history and decoder replay.

Window key sets, compressed candidates and closing entries are V4's (deepseek_v4/context.py,
index_plans.py) with non-overlapping windows: ratio 2 pools pairs, ratio 1 closes one entry per
token. V4.1 adds

- ``EngramPlan``: for every token its n-gram history ``(p, p-1, ..., p-n+1)`` as indices into
  ``pool = [ring ids of each step's n-1 positions before its first | fresh ids | blocked]``;
  positions below 0 or below the step's ``window_start`` are blocked (the pad id). The ring
  ``engram_ids`` of the SWA slot keeps the last ids of each sequence.
- ``decoder``: bounded replay of the decoder layers. A step that replays over prefix-cache
  blocks (``write_from > start_pos``) runs its replayed tokens through the encoder layers with
  windows truncated at ``window_start``; with ``decoder_replay_tokens`` set, the decoder layers
  (the CED source and above) see only the tokens from ``write_from - decoder_replay_tokens``
  on, windows truncated there. ``decoder`` then holds a second V4 context over that sub-batch
  and the rows of the full batch it takes (None when every decoder layer sees every token).
- ``embeds``: the rows of the batch inside image spans (``SeqStep.mm_inputs``) and their
  embeddings, which replace the token embeddings there (None when the batch has none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.models.deepseek_v4 import context as v4
from deepinfer.engine.models.deepseek_v4.context import BatchError, ForwardContext, Geometry
from deepinfer.engine.models.deepseek_v4.index_plans import padded_steps

__all__ = ["BatchError", "DecoderBatch", "EmbedRows", "EngramPlan", "V41ForwardContext", "V41Geometry", "build_context",
           "validate"]


@dataclass(frozen=True, slots=True)
class V41Geometry:
    base: Geometry
    engram_ngram: int = 0  # max n-gram size; 0 = no Engram
    engram_capacity: int = 0  # rows of the engram_ids ring
    decoder_replay_tokens: int | None = None  # bounded decoder replay (module docstring); None: off

    def __getattr__(self, name):  # the V4 plan builders read the base geometry's fields
        return getattr(self.base, name)


@dataclass(slots=True)
class EngramPlan:
    ring_rows: torch.Tensor  # [S * (n - 1)] engram_ids ring rows in front of the pool
    history: torch.Tensor  # [T, n] pool index of (p, p-1, ..., p-n+1); the last pool row = blocked
    ring_write: v4.RingWrite


@dataclass(slots=True)
class DecoderBatch:
    rows: torch.Tensor  # [T'] rows of the full batch the decoder layers compute
    ctx: ForwardContext  # V4 context of the sub-batch (its logit_index: rows of the sub-batch)


@dataclass(slots=True)
class EmbedRows:
    rows: torch.Tensor  # [N] batch rows inside image spans
    values: torch.Tensor  # [N, hidden] their embeddings (the vision tower's)


@dataclass(slots=True)
class V41ForwardContext(ForwardContext):
    engram: EngramPlan | None = None
    decoder: DecoderBatch | None = None
    embeds: EmbedRows | None = None


def validate(batch: ForwardBatch, geo: V41Geometry, num_slots: int) -> None:
    v4.validate(batch, geo.base, num_slots)


def build_context(batch: ForwardBatch, geo: V41Geometry, *, device: torch.device,
                  batch_invariant: bool) -> V41ForwardContext:
    base = v4.build_context(batch, geo.base, device=torch.device("cpu"), batch_invariant=batch_invariant)
    ctx = V41ForwardContext(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ForwardContext)})
    if geo.engram_ngram:
        ctx.engram = _engram_plan(batch, geo)
    if geo.decoder_replay_tokens is not None:
        ctx.decoder = _decoder_batch(batch, geo, batch_invariant)
    ctx.embeds = _embed_rows(batch)
    return _to_device(ctx, device) if torch.device(device).type != "cpu" else ctx


def _embed_rows(batch: ForwardBatch) -> EmbedRows | None:
    """The batch rows each step computes inside its image spans, with those positions' embeddings:

        step:   start_pos .................. end_pos          (rows offset .. offset + n)
        span:        mm.start ......... mm.end                (embeds rows 0 .. length)
        taken:       max(start, mm.start) .. min(end, mm.end)
    """
    rows, values, offset = [], [], 0
    for s in batch.steps:
        for mm in s.mm_inputs:
            lo, hi = max(mm.start, s.start_pos), min(mm.end, s.end_pos)
            if lo >= hi:
                continue
            if mm.embeds is None:
                raise BatchError(f"sequence {s.seq_id} computes positions {lo}..{hi - 1} of an image span that came "
                                 "without its embeddings")
            rows.append(torch.arange(offset + lo - s.start_pos, offset + hi - s.start_pos))
            values.append(mm.embeds[lo - mm.start : hi - mm.start])
        offset += s.num_tokens
    if not rows:
        return None
    device = values[0].device
    return EmbedRows(torch.cat(rows).to(device), torch.cat([v.to(device) for v in values]))


def _engram_plan(batch: ForwardBatch, geo: V41Geometry) -> EngramPlan:
    n, cap = geo.engram_ngram, geo.engram_capacity
    steps = batch.steps
    back = n - 1
    ring_rows, history, offset = [], [], 0
    num_tokens = batch.num_tokens
    ring_steps = padded_steps(np.fromiter((s.num_tokens for s in steps), dtype=np.int64, count=len(steps)), geo)
    num_ring = ring_steps * back  # padded steps (index_plans.padded_steps): ring row 0, never read as history
    blocked = num_ring + num_tokens
    for k, s in enumerate(steps):
        ring_rows.append(s.slot * cap + np.arange(s.start_pos - back, s.start_pos) % cap)
        pos = s.start_pos + np.arange(s.num_tokens)[:, None] - np.arange(n)[None, :]  # [t, n]
        fresh = num_ring + offset + (pos - s.start_pos)
        ring = k * back + (pos - (s.start_pos - back))
        idx = np.where(pos >= s.start_pos, fresh, ring)
        history.append(np.where(pos >= max(0, s.window_start), idx, blocked))
        offset += s.num_tokens
    ring_rows.append(np.zeros((ring_steps - len(steps)) * back, dtype=np.int64))
    return EngramPlan(
        ring_rows=torch.from_numpy(np.concatenate(ring_rows).astype(np.int64)),
        history=torch.from_numpy(np.concatenate(history).astype(np.int64)),
        ring_write=_ring_write(steps, cap),
    )


def _ring_write(steps: list[SeqStep], capacity: int) -> v4.RingWrite:
    """Each step writes its last min(n, capacity) fresh ids to ring row position % capacity."""
    rows, src, offset = [], [], 0
    for s in steps:
        first = max(s.start_pos, s.end_pos - capacity)
        pos = np.arange(first, s.end_pos)
        rows.append(s.slot * capacity + pos % capacity)
        src.append(offset + pos - s.start_pos)
        offset += s.num_tokens
    return v4.RingWrite(rows=torch.from_numpy(np.concatenate(rows).astype(np.int64)),
                        src=torch.from_numpy(np.concatenate(src).astype(np.int64)))


def _decoder_batch(batch: ForwardBatch, geo: V41Geometry, batch_invariant: bool) -> DecoderBatch | None:
    """The sub-batch of a bounded decoder replay, or None when no step replays past the bound."""
    keep, rows, first = [], [], 0
    trimmed = False
    for s in batch.steps:
        floor = s.start_pos
        if s.write_from > s.start_pos:
            floor = max(s.start_pos, s.write_from - geo.decoder_replay_tokens)
        cut = min(floor - s.start_pos, s.num_tokens - max(1, s.num_logits))  # logit rows stay in
        if cut > 0:
            trimmed = True
            start = s.start_pos + cut
            keep.append(dataclasses.replace(s, start_pos=start, token_ids=list(s.token_ids)[cut:],
                                            window_start=max(s.window_start, start)))
        else:
            cut = 0
            keep.append(s)
        rows.extend(range(first + cut, first + s.num_tokens))
        first += s.num_tokens
    if not trimmed:
        return None
    sub = v4.build_context(ForwardBatch(keep), geo.base, device=torch.device("cpu"), batch_invariant=batch_invariant)
    return DecoderBatch(rows=torch.tensor(rows, dtype=torch.long), ctx=sub)


def _to_device(ctx: V41ForwardContext, device: torch.device) -> V41ForwardContext:
    moved = v4._to_device(ctx, device)
    if ctx.engram is not None:
        e = ctx.engram
        moved.engram = EngramPlan(e.ring_rows.to(device), e.history.to(device),
                                  v4.RingWrite(e.ring_write.rows.to(device), e.ring_write.src.to(device)))
    if ctx.decoder is not None:
        moved.decoder = DecoderBatch(ctx.decoder.rows.to(device), v4._to_device(ctx.decoder.ctx, device))
    if ctx.embeds is not None:
        moved.embeds = EmbedRows(ctx.embeds.rows.to(device), ctx.embeds.values.to(device))
    return moved
