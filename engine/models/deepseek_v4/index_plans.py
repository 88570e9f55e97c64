"""Index plans of one forward: window key sets, closing compressed entries, ring writes.

Built on the host from ``StepArrays`` (context.py draws the pools they index) with numpy, whose
per-call cost on small arrays is a fraction of torch's; tensors are handed over without copies.
"""

from __future__ import annotations

import numpy as np
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


def candidate_bucket(num_entries: int) -> int:
    """Key-set size for a token that may see ``num_entries`` compressed entries: rounded up so
    few distinct sizes occur in a batch, and a function of the token's position alone."""
    if num_entries <= 0:
        return 0
    granule = 64 if num_entries <= 1024 else 1024
    return -(-num_entries // granule) * granule


def _buckets(num_entries: np.ndarray) -> np.ndarray:
    small = -(-num_entries // 64) * 64
    large = -(-num_entries // 1024) * 1024
    return np.where(num_entries <= 0, 0, np.where(num_entries <= 1024, small, large))


def window_lengths(positions: np.ndarray, window: int) -> np.ndarray:
    """L(t) = min(W, WINDOW_GRANULE * ceil((t + 1) / WINDOW_GRANULE))."""
    granule = min(WINDOW_GRANULE, window)
    return np.minimum((positions // granule + 1) * granule, window)


def rope_tables(positions: np.ndarray, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.rope_tables`` on the host: the float32 angle, cos/sin in float64 rounded to float32
    (every position gets the same value whatever else is in the batch), sin signed per pair."""
    angle = (positions.astype(np.float32)[:, None] * inv_freq.numpy()[None, :]).astype(np.float64)
    cos = np.repeat(np.cos(angle).astype(np.float32), 2, axis=1)
    sin = np.repeat(np.sin(angle).astype(np.float32), 2, axis=1)
    sin[:, 0::2] *= -1
    return torch.from_numpy(cos), torch.from_numpy(sin)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def _bias(valid: np.ndarray) -> torch.Tensor:
    """[G, 1, N] float32: 0 where valid, -inf elsewhere."""
    return _t(np.where(valid, np.float32(0), np.float32(NEG_INF))[:, None, :])


def _ring_write(a: StepArrays, capacity: int) -> RingWrite:
    """Each step writes its last min(n, capacity) fresh rows to ring row position % capacity."""
    ends = a.starts + a.lengths
    firsts = np.maximum(a.starts, ends - capacity)
    counts = ends - firsts
    step = np.repeat(np.arange(len(counts)), counts)
    pos = firsts[step] + np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[step]
    rows = a.slots[step] * capacity + pos % capacity
    src = np.asarray(a.offsets[:-1])[step] + pos - a.starts[step]
    return RingWrite(rows=_t(rows), src=_t(src))


def _window_rows(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int):
    """Pool rows (flat, window rows then the sink row) and bias of ``index``'s window key sets
    (``index`` None: all tokens). The same sets serve every layer kind: built once per forward."""
    key = (length, None if index is None else index.tobytes())
    cached = a.window_cache.get(key)
    if cached is None:
        cached = a.window_cache[key] = _build_window_rows(a, geo, index, length)
    return cached


def _build_window_rows(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int):
    if index is None:
        index = np.arange(len(a.positions))
    w, num_steps = geo.sliding_window, len(a.steps)
    t = a.positions[index][:, None]
    step = a.tok_step[index][:, None]
    start = a.starts[step]
    key_pos = t + np.arange(-(length - 1), 1)[None, :]  # [G, L]
    ring_index = step * (w - 1) + (key_pos - (start - (w - 1)))
    fresh_index = num_steps * (w - 1) + index[:, None] - (t - key_pos)
    rows = np.empty((len(index), length + 1), dtype=np.int64)
    rows[:, :length] = np.where(key_pos < start, ring_index, fresh_index)
    rows[:, length] = num_steps * (w - 1) + a.num_rows  # the pool's zero row: the sink
    valid = np.ones((len(index), length + 1), dtype=bool)
    valid[:, :length] = key_pos >= a.window_floor[step]
    return _t(rows.reshape(-1)), _bias(valid)


def _grouped(a: StepArrays, geo: Geometry, lengths: np.ndarray, buckets: np.ndarray):
    """Yield (token index or None, L, B) for tokens of equal (L, B), in memory-bounded chunks."""
    num_tokens = len(a.positions)
    keys = lengths.astype(np.int64) * (1 << 32) + buckets
    distinct = np.unique(keys)
    for key in distinct.tolist():
        length, bucket = key >> 32, key & ((1 << 32) - 1)
        max_rows = max(1, geo.max_group_key_rows // (length + 1 + bucket))
        if len(distinct) == 1 and num_tokens <= max_rows:
            yield None, length, bucket
            continue
        index = np.flatnonzero(keys == key)
        for lo in range(0, len(index), max_rows):
            yield index[lo : lo + max_rows], length, bucket


def _torch_index(index: np.ndarray | None) -> torch.Tensor | None:
    return None if index is None else _t(index)


def window_plan(a: StepArrays, geo: Geometry) -> WindowPlan:
    w, cap = geo.sliding_window, geo.window_capacity
    back = np.arange(-(w - 1), 0)  # the W-1 positions before a step's first one
    ring_rows = (a.slots[:, None] * cap + (a.starts[:, None] + back[None, :]) % cap).reshape(-1)
    lengths = window_lengths(a.positions, w)
    groups = []
    for index, length, _ in _grouped(a, geo, lengths, np.zeros_like(lengths)):
        rows, bias = _window_rows(a, geo, index, length)
        groups.append(TokenGroup(_torch_index(index), length, rows, bias))
    return WindowPlan(ring_rows=_t(ring_rows), ring_write=_ring_write(a, cap), groups=groups)


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
        win_rows, win_bias = _window_rows(a, geo, index, length)
        if bucket == 0:
            groups.append(TokenGroup(_torch_index(index), length, win_rows, win_bias))
            continue
        part = np.arange(len(a.positions)) if index is None else index
        w = np.arange(bucket)
        step = a.tok_step[part][:, None]
        logical = np.minimum(((w * ratio) // geo.block_size)[None, :], a.table_len[step] - 1)
        rows = a.tables[step, logical] * rows_per_block + (w % rows_per_block)[None, :]
        valid = w[None, :] < num_entries[part][:, None]
        groups.append(TokenGroup(_torch_index(index), length, win_rows, win_bias, bucket, _t(rows), _t(valid), _bias(valid)))
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
    j = np.arange(span)
    ring_rows, src_index, src_valid, entry_pos, dst_rows = [], [], [], [], []
    for k, (i, s, first, last) in enumerate(closing):
        w = np.arange(first, last)
        ring_first = s.start_pos - (span - 1)
        ring_rows.append(s.slot * cap + np.arange(ring_first, s.start_pos) % cap)
        src_pos = w[:, None] * ratio - (span - ratio) + j[None, :]  # [E_i, span]
        ring_idx = k * (span - 1) + (src_pos - ring_first)
        fresh_idx = num_ring + a.offsets[i] + (src_pos - s.start_pos)
        src_index.append(np.where(src_pos < s.start_pos, ring_idx, fresh_idx))
        src_valid.append(src_pos >= max(0, s.window_start))
        entry_pos.append(w * ratio)
        table = np.asarray(list(s.block_table), dtype=np.int64)
        dst_rows.append(table[(w * ratio) // geo.block_size] * rows_per_block + w % rows_per_block)
    cos, sin = rope_tables(np.concatenate(entry_pos), geo.inv_freq["compress"])
    return EntryPlan(
        ring_rows=_t(np.concatenate(ring_rows)),
        src_index=_t(np.concatenate(src_index)),
        src_valid=_t(np.concatenate(src_valid)),
        cos=cos,
        sin=sin,
        dst_rows=_t(np.concatenate(dst_rows)),
    )
