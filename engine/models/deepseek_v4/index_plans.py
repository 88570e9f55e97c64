"""Index plans of one forward: window key sets, closing compressed entries, ring writes.

Built on the host from ``StepArrays`` (context.py draws the pools they index) with numpy, whose
per-call cost on small arrays is a fraction of torch's; tensors are handed over without copies.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.engine.core.cuda_graphs import pads_shapes, shape_bucket
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
    if len(num_entries) == 1:  # a decode step of one sequence: plain integers cost less than 6 ufuncs
        return np.array([candidate_bucket(int(num_entries[0]))], dtype=num_entries.dtype)
    small = -(-num_entries // 64) * 64
    large = -(-num_entries // 1024) * 1024
    return np.where(num_entries <= 0, 0, np.where(num_entries <= 1024, small, large))


def window_lengths(positions: np.ndarray, window: int) -> np.ndarray:
    """L(t) = min(W, WINDOW_GRANULE * ceil((t + 1) / WINDOW_GRANULE))."""
    granule = min(WINDOW_GRANULE, window)
    return np.minimum((positions // granule + 1) * granule, window)


def _rope_rows(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos = np.repeat(np.cos(angle).astype(np.float32), 2, axis=1)
    sin = np.repeat(np.sin(angle).astype(np.float32), 2, axis=1)
    sin[:, 0::2] *= -1
    return cos, sin


ROPE_TABLE_POSITIONS = 1 << 14  # rows of a cached table per frequency set (2 x 4 MB at 64 dims)
# id(inv_freq) -> (inv_freq, cos [P, D], sin [P, D]): the tensor is kept, so its id stays its own
_ROPE_CACHE: dict[int, tuple[torch.Tensor, np.ndarray, np.ndarray]] = {}


def rope_tables(positions: np.ndarray, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.rope_tables`` on the host: the float32 angle, cos/sin in float64 rounded to float32
    (every position gets the same value whatever else is in the batch), sin signed per pair.
    Positions below ``ROPE_TABLE_POSITIONS`` are rows of a table computed once per frequency
    set (the same values: each row is a function of its position alone); a forward's rows are
    then one gather instead of a cos and a sin per step."""
    if len(positions) and int(positions.max()) < ROPE_TABLE_POSITIONS and int(positions.min()) >= 0:
        cached = _ROPE_CACHE.get(id(inv_freq))
        if cached is None or cached[0] is not inv_freq:
            if len(_ROPE_CACHE) >= 8:  # a few frequency sets per model; stay bounded
                _ROPE_CACHE.clear()
            cached = _ROPE_CACHE[id(inv_freq)] = (inv_freq, *_rope_rows(np.arange(ROPE_TABLE_POSITIONS),
                                                                         inv_freq.numpy()))
        return torch.from_numpy(cached[1][positions]), torch.from_numpy(cached[2][positions])
    cos, sin = _rope_rows(positions, inv_freq.numpy())
    return torch.from_numpy(cos), torch.from_numpy(sin)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def _prefix_rows(template: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Rows ``template[width - c : 2 * width - c]`` for each c of ``count`` (0 <= c <= width): c
    entries of the template's first half then width - c of its second, one gather (``template``:
    the [width + 1, width] sliding-window view of 2 * width entries)."""
    return template[template.shape[1] - count]


_TEMPLATES: dict = {}  # (first, second, width, dtype) -> read-only template view, shared by all forwards


def _template(first, second, width: int, dtype) -> np.ndarray:
    """The [width + 1, width] sliding-window view of ``width * [first] + width * [second]``."""
    key = (first, second, width, dtype)
    view = _TEMPLATES.get(key)
    if view is None:
        if len(_TEMPLATES) >= 1024:  # widths are buckets and window lengths: few, but stay bounded
            _TEMPLATES.clear()
        values = np.empty(2 * width, dtype=dtype)
        values[:width], values[width:] = first, second
        view = _TEMPLATES[key] = np.lib.stride_tricks.sliding_window_view(values, width)
    return view


def _prefix_templates(width: int) -> tuple[np.ndarray, np.ndarray]:
    """(bool, float32) templates of ``_prefix_rows``: width True / 0 entries, then width False / -inf."""
    return _template(True, False, width, bool), _template(0.0, NEG_INF, width, np.float32)


def _ring_write(a: StepArrays, capacity: int) -> RingWrite:
    """Each step writes its last min(n, capacity) fresh rows to ring row position % capacity."""
    if a.decode:  # one token per step: row start % capacity, source the step's own row
        return RingWrite(rows=_t(a.slots * capacity + a.starts % capacity), src=_t(np.arange(len(a.starts))))
    ends = a.starts + a.lengths
    firsts = np.maximum(a.starts, ends - capacity)
    counts = ends - firsts
    step = np.repeat(np.arange(len(counts)), counts)
    pos = firsts[step] + np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[step]
    rows = a.slots[step] * capacity + pos % capacity
    src = np.asarray(a.offsets[:-1])[step] + pos - a.starts[step]
    return RingWrite(rows=_t(rows), src=_t(src))


def _window_lengths(a: StepArrays, geo: Geometry) -> np.ndarray:
    lengths = a.window_cache.get("lengths")
    if lengths is None:
        lengths = a.window_cache["lengths"] = window_lengths(a.positions, geo.sliding_window)
    return lengths


def _window_rows(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int):
    """Pool rows (flat, window rows then the sink row) and bias of ``index``'s window key sets
    (``index`` None: all tokens). The same sets serve every layer kind: the sets of all tokens of
    window length ``length`` are built once per forward and a group takes a view of its rows (a
    copy where its tokens are not consecutive among them)."""
    key = (length, None if index is None else index.tobytes())
    cached = a.window_cache.get(key)
    if cached is None:
        members, rows, bias = _window_class(a, geo, length)
        if index is None or (members is None and len(index) == len(a.positions)):
            lo, hi = 0, len(rows)  # index None: every token has this length
        else:
            at = index if members is None else np.searchsorted(members, index)
            lo, hi = int(at[0]), int(at[-1]) + 1
            if hi - lo != len(at):
                rows, bias, lo, hi = rows[at], bias[at], 0, len(at)
        cached = a.window_cache[key] = (torch.from_numpy(rows[lo:hi].reshape(-1)), torch.from_numpy(bias[lo:hi]))
    return cached


def _window_group(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int, **candidates) -> TokenGroup:
    """The TokenGroup of ``index``'s tokens (window length ``length``): full window rows and
    bias, or with ``geo.compact_candidates`` their plan (``TokenGroup.win_plan``)."""
    if not geo.compact_candidates:
        rows, bias = _window_rows(a, geo, index, length)
        return TokenGroup(_torch_index(index), length, rows, bias, **candidates)
    plan, sink = _window_plan(a, geo, index, length)
    return TokenGroup(_torch_index(index), length, None, None, **candidates, win_plan=plan, win_sink=sink)


def _window_plan(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int) -> tuple[torch.Tensor, int]:
    """(``[G, 4]`` (fresh, ring, split, masked) per token, the sink row): ``_build_window_rows``'s
    rows and bias in the compact form ``TokenGroup.expand_window`` expands."""
    key = ("plan", length, None if index is None else index.tobytes())
    cached = a.window_cache.get(key)
    if cached is None:
        w, num_steps = geo.sliding_window, a.ring_steps
        if index is None:
            index = np.arange(len(a.positions))
        t = a.positions[index]
        step = a.tok_step[index]
        start = a.starts[step]
        plan = np.empty((len(index), 4), dtype=np.int64)
        plan[:, 0] = num_steps * (w - 1) + index - (length - 1)
        plan[:, 1] = step * (w - 1) + t - (length - 1) - (start - (w - 1))
        plan[:, 2] = np.clip(start - t + (length - 1), 0, length)
        plan[:, 3] = np.clip(a.window_floor[step] - t + (length - 1), 0, length)
        cached = a.window_cache[key] = (torch.from_numpy(plan), int(num_steps * (w - 1) + a.num_rows))
    return cached


def _window_class(a: StepArrays, geo: Geometry, length: int):
    """(tokens of window length L in flat order or None for all, rows [N, L + 1], bias [N, 1, L + 1])."""
    key = ("class", length)
    cached = a.window_cache.get(key)
    if cached is None:
        lengths = _window_lengths(a, geo)
        members = None if bool((lengths == length).all()) else np.flatnonzero(lengths == length)
        cached = a.window_cache[key] = (members, *_build_window_rows(a, geo, members, length))
    return cached


def _build_window_rows(a: StepArrays, geo: Geometry, index: np.ndarray | None, length: int):
    """Row j < L of token t (step s, flat index i) holds key position p = t - (L - 1) + j: the
    step's ring row ``s * (W - 1) + p - (start - (W - 1))`` below the step's start, else the fresh
    row ``S * (W - 1) + i - (t - p)``; both are a per-token offset plus j. Valid: p >= window floor."""
    if index is None:
        index = np.arange(len(a.positions))
    w, num_steps = geo.sliding_window, a.ring_steps
    t = a.positions[index]
    step = a.tok_step[index]
    start = a.starts[step]
    j = np.arange(length)
    rows = np.empty((len(index), length + 1), dtype=np.int64)
    fresh = num_steps * (w - 1) + index - (length - 1)
    np.add(fresh[:, None], j[None, :], out=rows[:, :length])
    ring_split = start - t + (length - 1)  # rows j < ring_split are ring rows
    sel = np.flatnonzero(ring_split > 0)
    if len(sel):
        if len(sel) == len(index):
            sel = slice(None)  # every token (a decode): no gathers
        ring = (step * (w - 1) + t - (length - 1) - (start - (w - 1)))[sel]
        rows[sel, :length] = np.where(j[None, :] < ring_split[sel, None], ring[:, None] + j[None, :], rows[sel, :length])
    rows[:, length] = num_steps * (w - 1) + a.num_rows  # the pool's zero row: the sink
    masked = np.minimum(a.window_floor[step] - t + (length - 1), length)  # rows j < masked are masked
    bias = np.zeros((len(index), 1, length + 1), dtype=np.float32)
    sel = np.flatnonzero(masked > 0)
    if len(sel):
        bias[sel, 0, :] = _prefix_rows(_template(NEG_INF, 0.0, length + 1, np.float32), masked[sel])
    return rows, bias


def _grouped(a: StepArrays, geo: Geometry, lengths: np.ndarray, buckets: np.ndarray):
    """Yield (token index or None, L, B) for tokens of equal (L, B), in memory-bounded chunks; a
    decode or verify forward (``geo.merge_step_tokens``) as one group of the largest L and B."""
    num_tokens = len(a.positions)
    # (the compact form only: the full form's window rows are built per length class)
    if (geo.merge_step_tokens and geo.compact_candidates and num_tokens > 1
            and int(a.lengths.max()) <= geo.merge_step_tokens):
        length, bucket = int(lengths.max()), int(buckets.max())
        if num_tokens * (length + 1 + bucket) <= geo.max_group_key_rows:
            yield None, length, bucket
            return
    keys = lengths.astype(np.int64) * (1 << 32) + buckets
    if num_tokens == 1 or bool((keys == keys[0]).all()):
        distinct, order, bounds = keys[:1], None, None
    else:
        order = np.argsort(keys, kind="stable")  # tokens of each key in flat order
        sorted_keys = keys[order]
        bounds = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
        distinct = sorted_keys[np.concatenate([[0], bounds])]
        bounds = [0, *bounds.tolist(), num_tokens]
    for k, key in enumerate(distinct.tolist()):
        length, bucket = key >> 32, key & ((1 << 32) - 1)
        max_rows = max(1, geo.max_group_key_rows // (length + 1 + bucket))
        if order is None:
            if num_tokens <= max_rows:
                yield None, length, bucket
                continue
            index = np.arange(num_tokens)
        else:
            index = order[bounds[k] : bounds[k + 1]]
        for lo in range(0, len(index), max_rows):
            yield index[lo : lo + max_rows], length, bucket


def _torch_index(index: np.ndarray | None) -> torch.Tensor | None:
    return None if index is None else _t(index)


def window_plan(a: StepArrays, geo: Geometry) -> WindowPlan:
    w, cap = geo.sliding_window, geo.window_capacity
    back = np.arange(-(w - 1), 0)  # the W-1 positions before a step's first one
    ring_rows = (a.slots[:, None] * cap + (a.starts[:, None] + back[None, :]) % cap).reshape(-1)
    if a.ring_steps > len(a.starts):  # padded steps (``padded_steps``): ring row 0, never attended
        ring_rows = np.concatenate([ring_rows, np.zeros((a.ring_steps - len(a.starts)) * (w - 1), dtype=np.int64)])
    lengths = _window_lengths(a, geo)
    groups = []
    for index, length, _ in _grouped(a, geo, lengths, np.zeros_like(lengths)):
        groups.append(_window_group(a, geo, index, length))
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
        entries=_padded_entries(_entry_plan(ratio, span, cap, a, geo), ratio, span, a, geo),
        ring_write=_ring_write(a, cap),
        groups=_compress_groups(ratio, a, geo),
    )


def _candidate_rows(ratio: int, bucket: int, steps: np.ndarray, a: StepArrays, geo: Geometry) -> np.ndarray:
    """[len(steps), B] block-cache rows of entries 0..B-1 of each step's table (logical blocks
    clamped to the table's last)."""
    w = np.arange(bucket)
    rows_per_block = geo.block_size // ratio
    flat = np.minimum(((w * ratio) // geo.block_size)[None, :], a.table_len[steps][:, None] - 1)
    flat += (steps * a.tables.shape[1])[:, None]
    rows = np.take(a.tables.reshape(-1), flat)
    rows *= rows_per_block
    rows += (w % rows_per_block)[None, :]
    return rows


def _compress_groups(ratio: int, a: StepArrays, geo: Geometry) -> list[TokenGroup]:
    """Candidates of a token depend on its step alone (its table) but for the valid prefix
    w < (t + 1) // r: rows are one row per step broadcast over the group's tokens, valid and bias
    gathered from prefix templates."""
    num_entries = (a.positions + 1) // ratio  # entries closed at or before each token
    lengths = _window_lengths(a, geo)
    groups = []
    step_rows: dict = {}  # (B, step) -> [B] rows
    for index, length, bucket in _grouped(a, geo, lengths, _buckets(num_entries)):
        if bucket == 0:
            groups.append(_window_group(a, geo, index, length))
            continue
        steps = a.tok_step if index is None else a.tok_step[index]
        count = np.minimum(num_entries if index is None else num_entries[index], bucket)
        cand = None  # compact candidates: the group's candidate fields
        if steps[0] == steps[-1]:  # tokens are in step order: one step
            s = int(steps[0])
            row = step_rows.get((bucket, s))
            if row is None:
                row = step_rows[bucket, s] = _candidate_rows(ratio, bucket, steps[:1], a, geo)[0]
            if geo.compact_candidates:
                rows = row[None, :]
            else:
                rows = np.empty((len(steps), bucket), dtype=np.int64)
                rows[...] = row
        elif a.decode and len(steps) == len(a.steps):  # the one token of every step
            rows = _candidate_rows(ratio, bucket, steps, a, geo)
        else:
            distinct, inverse = np.unique(steps, return_inverse=True)
            table = _candidate_rows(ratio, bucket, distinct, a, geo)
            if geo.compact_candidates:  # one row per step, gathered per token on the device
                if a.ring_steps > len(a.starts):  # padded steps: rows no token reads
                    table = np.concatenate([table, np.zeros((a.ring_steps - len(table), bucket), dtype=np.int64)])
                cand = dict(cand_table=_t(table), cand_step=_t(inverse.reshape(-1)))
            else:
                rows = np.take(table, inverse.reshape(-1), axis=0)
        if geo.compact_candidates:
            cand = cand or dict(cand_rows=_t(rows))
            groups.append(_window_group(a, geo, index, length, num_candidates=bucket, cand_count=_t(count), **cand))
            continue
        valid_t, bias_t = _prefix_templates(bucket)
        valid = _prefix_rows(valid_t, count)
        bias = _prefix_rows(bias_t, count)[:, None, :]
        groups.append(_window_group(a, geo, index, length, num_candidates=bucket, cand_rows=torch.from_numpy(rows),
                                    cand_valid=torch.from_numpy(valid), cand_bias=torch.from_numpy(bias)))
    return groups


def padded_steps(lengths: np.ndarray, geo) -> int:
    """Steps a forward's per-step pools are laid out for: a decode or verify forward of a model
    replaying CUDA graphs (``geo.dump_block`` >= 0, every step <= ``merge_step_tokens``) pads its
    step count S to ``shape_bucket(S)`` (window and Engram ring rows, candidate tables: rows no
    token reads), so a request joining or leaving a verify batch keeps its shapes; else S."""
    num_steps = len(lengths)
    return shape_bucket(num_steps) if pads_shapes(geo, int(lengths.max())) else num_steps


def _entry_shape(ratio: int, a: StepArrays, geo: Geometry, num_entries: int, num_closing: int) -> tuple[int, int]:
    """(entries, closing steps) a padded forward's plan has. A ratio up to ``merge_step_tokens``
    (CSA's 4) closes entries at nearly every step: its shape comes from bounds the forward's
    other shapes already fix (T tokens over S steps close at most (T + S (r - 1)) // r entries, in
    at most S steps; S the padded step count, ``padded_steps``), so it adds no signature of its
    own. A larger ratio (HCA's 128) closes an entry in few steps (at most one each): a power of two
    >= 4 over the actual count, so a handful of entries are pooled for nothing instead of up to S."""
    num_steps, num_tokens = a.ring_steps, int(a.offsets[-1])  # the padded step count (>= S)
    if ratio <= geo.merge_step_tokens:
        return shape_bucket((num_tokens + num_steps * (ratio - 1)) // ratio), num_steps
    return max(4, 1 << (num_entries - 1).bit_length()), max(4, 1 << (num_closing - 1).bit_length())


def _padded_entries(plan: EntryPlan | None, ratio: int, span: int, a: StepArrays, geo: Geometry) -> EntryPlan | None:
    """A decode or verify forward of a model whose forwards replay CUDA graphs (``geo.dump_block``
    >= 0, every step <= ``merge_step_tokens``): the entries closing in it padded (``_entry_shape``),
    never None, so a step's shapes do not change with how many windows close in it. A padding
    entry reads pool row 0 and writes the block cache's dump block (block_cache.py); a padding
    ring row reads ring row 0. The fresh rows' indices shift by the ring rows added in front."""
    if not pads_shapes(geo, int(a.lengths.max())):
        return plan
    ring_per = span - 1
    num_entries = 0 if plan is None else int(plan.dst_rows.shape[0])
    num_ring = 0 if plan is None else int(plan.ring_rows.shape[0])
    entries_to, closing_to = _entry_shape(ratio, a, geo, num_entries, num_ring // ring_per if ring_per else 0)
    ring_to = closing_to * ring_per
    extra = entries_to - num_entries
    dump = geo.dump_block * (geo.block_size // ratio)
    cos, sin = rope_tables(np.zeros(extra, dtype=np.int64), geo.inv_freq["compress"])
    pad_index = torch.zeros(extra, span, dtype=torch.long)
    pad_valid = torch.ones(extra, span, dtype=torch.bool)
    pad_rows = torch.zeros(ring_to - num_ring, dtype=torch.long)
    if plan is None:
        return EntryPlan(ring_rows=pad_rows, src_index=pad_index, src_valid=pad_valid, cos=cos, sin=sin,
                         dst_rows=torch.full((extra,), dump, dtype=torch.long))
    src_index = plan.src_index
    if ring_to > num_ring:  # the fresh rows move behind the added ring rows
        src_index = torch.where(src_index >= num_ring, src_index + (ring_to - num_ring), src_index)
    return EntryPlan(
        ring_rows=torch.cat([plan.ring_rows, pad_rows]),
        src_index=torch.cat([src_index, pad_index]),
        src_valid=torch.cat([plan.src_valid, pad_valid]),
        cos=torch.cat([plan.cos, cos]),
        sin=torch.cat([plan.sin, sin]),
        dst_rows=torch.cat([plan.dst_rows, torch.full((extra,), dump, dtype=torch.long)]),
    )


def _entry_plan(ratio: int, span: int, cap: int, a: StepArrays, geo: Geometry) -> EntryPlan | None:
    """Windows closing in each step (not those starting below its write_from), all steps at once:
    entry w of closing step k (flat step i) reads source positions w * r - (span - r) + j, the
    ring pool rows of step k below the step's start, else fresh rows."""
    if len(a.starts) == 1:  # one step: decide in plain integers whether any window closes
        start = int(a.starts[0])
        if (start + int(a.lengths[0])) // ratio <= max(start // ratio, -(-int(a.write_from[0]) // ratio)):
            return None
    ends = a.starts + a.lengths
    first = np.maximum(a.starts // ratio, -(-a.write_from // ratio))
    last = ends // ratio  # exclusive: windows whose last source position is < end_pos
    closing = np.flatnonzero(last > first)
    if not len(closing):
        return None
    rows_per_block = geo.block_size // ratio
    num_ring = len(closing) * (span - 1)  # the pool's fresh rows start here
    counts = (last - first)[closing]
    start = a.starts[closing]
    ring_rows = a.slots[closing, None] * cap + (start[:, None] + np.arange(-(span - 1), 0)[None, :]) % cap
    if len(closing) == 1:
        k = np.zeros(int(counts[0]), dtype=np.int64)
        w = first[closing[0]] + np.arange(int(counts[0]))
    else:
        k = np.repeat(np.arange(len(closing)), counts)
        w = first[closing][k] + np.arange(len(k)) - (np.cumsum(counts) - counts)[k]
    step = closing[k]
    entry_pos = w * ratio
    src_pos = (entry_pos - (span - ratio))[:, None] + np.arange(span)[None, :]  # [E, span]
    start = start[k][:, None]
    fresh = (num_ring + np.asarray(a.offsets[:-1])[step])[:, None] + (src_pos - start)
    src_index = np.where(src_pos < start, (k * (span - 1))[:, None] + (src_pos - (start - (span - 1))), fresh)
    cos, sin = rope_tables(entry_pos, geo.inv_freq["compress"])
    return EntryPlan(
        ring_rows=_t(ring_rows.reshape(-1)),
        src_index=_t(src_index),
        src_valid=_t(src_pos >= a.window_floor[step][:, None]),
        cos=cos,
        sin=sin,
        dst_rows=_t(a.tables[step, entry_pos // geo.block_size] * rows_per_block + w % rows_per_block),
    )
