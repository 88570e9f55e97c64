"""Index plans of one forward: window key sets, closing compressed entries, ring writes.

All built on the host from ``StepArrays`` (context.py draws the pools they index).
"""

from __future__ import annotations

import math

import torch

from deepinfer.engine.models.deepseek_v4.context import (
    NEG_INF,
    WINDOW_GRANULE,
    CompressPlan,
    EntryPlan,
    Geometry,
    RingWrite,
    StepArrays,
    TokenGroup,
    WindowPlan,
)
from deepinfer.kernels import ops

LONG = torch.long


def candidate_bucket(num_entries: int) -> int:
    """Key-set size for a token that may see ``num_entries`` compressed entries: rounded up so
    few distinct sizes occur in a batch, and a function of the token's position alone."""
    if num_entries <= 0:
        return 0
    granule = 64 if num_entries <= 1024 else 1024
    return granule * math.ceil(num_entries / granule)


def _buckets(num_entries: torch.Tensor) -> torch.Tensor:
    """``candidate_bucket`` over a tensor."""
    small = 64 * torch.div(num_entries + 63, 64, rounding_mode="floor")
    large = 1024 * torch.div(num_entries + 1023, 1024, rounding_mode="floor")
    return torch.where(num_entries <= 0, 0, torch.where(num_entries <= 1024, small, large))


def window_lengths(positions: torch.Tensor, window: int) -> torch.Tensor:
    """L(t) = min(W, WINDOW_GRANULE * ceil((t + 1) / WINDOW_GRANULE))."""
    granule = min(WINDOW_GRANULE, window)
    rounded = granule * torch.div(positions + granule, granule, rounding_mode="floor")
    return torch.clamp(rounded, max=window)


def _ring_write(a: StepArrays, capacity: int) -> RingWrite:
    rows, src = [], []
    for i, s in enumerate(a.steps):
        first = max(s.start_pos, s.end_pos - capacity)
        base = s.slot * capacity
        rows.extend(base + p % capacity for p in range(first, s.end_pos))
        src.extend(range(a.offsets[i] + first - s.start_pos, a.offsets[i + 1]))
    return RingWrite(rows=torch.tensor(rows, dtype=LONG), src=torch.tensor(src, dtype=LONG))


def _window_rows(a: StepArrays, geo: Geometry, index: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows (flat, window rows then the sink row) and bias of ``index``'s window key sets."""
    w, num_steps = geo.sliding_window, len(a.steps)
    t = a.positions[index][:, None]
    step = a.tok_step[index][:, None]
    start = a.starts[step]
    key_pos = t + torch.arange(-(length - 1), 1)[None, :]  # [G, L]
    ring_index = step * (w - 1) + (key_pos - (start - (w - 1)))
    fresh_index = num_steps * (w - 1) + index[:, None] - (t - key_pos)
    rows = torch.where(key_pos < start, ring_index, fresh_index)
    sink = torch.full((len(index), 1), num_steps * (w - 1) + a.num_rows, dtype=LONG)
    valid = key_pos >= a.window_floor[step]
    bias = torch.zeros(len(index), 1, length + 1)
    bias[:, 0, :length].masked_fill_(~valid, NEG_INF)
    return torch.cat([rows, sink], dim=1).reshape(-1), bias


def _grouped(a: StepArrays, geo: Geometry, lengths: torch.Tensor, buckets: torch.Tensor):
    """Yield (token index or None, L, B) for tokens of equal (L, B), in memory-bounded chunks."""
    num_tokens = len(a.positions)
    keys = lengths * (1 << 32) + buckets
    distinct = torch.unique(keys).tolist()
    for key in distinct:
        length, bucket = key >> 32, key & ((1 << 32) - 1)
        max_rows = max(1, geo.max_group_key_rows // (length + 1 + bucket))
        if len(distinct) == 1 and num_tokens <= max_rows:
            yield None, length, bucket
            continue
        index = torch.nonzero(keys == key).flatten()
        for part in index.split(max_rows):
            yield part, length, bucket


def window_plan(a: StepArrays, geo: Geometry) -> WindowPlan:
    w, cap = geo.sliding_window, geo.window_capacity
    back = torch.arange(-(w - 1), 0)  # the W-1 positions before a step's first one
    ring_rows = (a.slots[:, None] * cap + (a.starts[:, None] + back[None, :]).remainder(cap)).reshape(-1)
    lengths = window_lengths(a.positions, w)
    groups = []
    for index, length, _ in _grouped(a, geo, lengths, torch.zeros_like(lengths)):
        rows, bias = _window_rows(a, geo, torch.arange(len(a.positions)) if index is None else index, length)
        groups.append(TokenGroup(index, length, rows, bias))
    return WindowPlan(ring_rows=ring_rows, ring_write=_ring_write(a, cap), groups=groups)


def compress_plan(kind: tuple[int, bool], a: StepArrays, geo: Geometry) -> CompressPlan:
    ratio, overlap = kind
    span = 2 * ratio if overlap else ratio
    cap = span + geo.lookahead
    return CompressPlan(
        ratio=ratio,
        overlap=overlap,
        span=span,
        capacity=cap,
        entries=_entry_plan(ratio, span, cap, a, geo),
        ring_write=_ring_write(a, cap),
        groups=_compress_groups(ratio, a, geo),
    )


def _compress_groups(ratio: int, a: StepArrays, geo: Geometry) -> list[TokenGroup]:
    rows_per_block = geo.block_size // ratio
    num_entries = (a.positions + 1) // ratio  # entries closed at or before each token
    lengths = window_lengths(a.positions, geo.sliding_window)
    groups = []
    for index, length, bucket in _grouped(a, geo, lengths, _buckets(num_entries)):
        part = torch.arange(len(a.positions)) if index is None else index
        win_rows, win_bias = _window_rows(a, geo, part, length)
        if bucket == 0:
            groups.append(TokenGroup(index, length, win_rows, win_bias))
            continue
        w = torch.arange(bucket)
        step = a.tok_step[part][:, None]
        logical = torch.minimum(((w * ratio) // geo.block_size)[None, :], a.table_len[step] - 1)
        rows = a.tables[step, logical] * rows_per_block + (w % rows_per_block)[None, :]
        valid = w[None, :] < num_entries[part][:, None]
        bias = torch.zeros(valid.shape).masked_fill_(~valid, NEG_INF)[:, None, :]
        groups.append(TokenGroup(index, length, win_rows, win_bias, bucket, rows, valid, bias))
    return groups


def _entry_plan(ratio: int, span: int, cap: int, a: StepArrays, geo: Geometry) -> EntryPlan | None:
    # pass 1: which windows close in each step (not those starting below write_from)
    closing = []
    for i, s in enumerate(a.steps):
        first = max(s.start_pos // ratio, -(-s.write_from // ratio))
        last = s.end_pos // ratio  # exclusive: windows whose last source position is < end_pos
        if last > first:
            closing.append((i, s, first, last))
    if not closing:
        return None
    rows_per_block = geo.block_size // ratio
    num_ring = len(closing) * (span - 1)  # the pool's fresh rows start here
    j = torch.arange(span)
    ring_rows, src_index, src_valid, entry_pos, dst_rows = [], [], [], [], []
    for k, (i, s, first, last) in enumerate(closing):
        w = torch.arange(first, last)
        ring_first = s.start_pos - (span - 1)
        ring_rows.append(s.slot * cap + torch.arange(ring_first, s.start_pos).remainder(cap))
        src_pos = w[:, None] * ratio - (span - ratio) + j[None, :]  # [E_i, span]
        ring_idx = k * (span - 1) + (src_pos - ring_first)
        fresh_idx = num_ring + a.offsets[i] + (src_pos - s.start_pos)
        src_index.append(torch.where(src_pos < s.start_pos, ring_idx, fresh_idx))
        src_valid.append(src_pos >= max(0, s.window_start))
        entry_pos.append(w * ratio)
        table = torch.as_tensor(list(s.block_table), dtype=LONG)
        dst_rows.append(table[(w * ratio) // geo.block_size] * rows_per_block + w % rows_per_block)
    cos, sin = ops.rope_tables(torch.cat(entry_pos), geo.inv_freq["compress"])
    return EntryPlan(
        ring_rows=torch.cat(ring_rows),
        src_index=torch.cat(src_index),
        src_valid=torch.cat(src_valid),
        cos=cos,
        sin=sin,
        dst_rows=torch.cat(dst_rows),
    )
