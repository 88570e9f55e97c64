"""Per-forward index metadata for DeepSeek-V4: built once from a ForwardBatch, shared by all layers.

Tokens of all steps are flattened in step order (T tokens). Every token attends to a key set of
a size that depends only on its own position, never on the batch or the chunking:

  window part   W rows: positions t-W+1 .. t (masked below max(0, window_start))
  compressed    B candidate entries 0 .. B-1 of its layer's ratio r, B = bucket((t+1) // r),
                masked at w >= (t+1) // r (HCA attends all of them, CSA scores them with the
                indexer and attends its top-k)

Window rows come from a per-layer *pool*: for each step the W-1 ring rows before its first
position, then the T freshly computed rows:

    pool = [ring rows of step 0 (W-1) | ... | ring rows of step S-1 (W-1) | fresh rows (T)]

Compressed entries that close in this forward (windows ending inside a step, starting at or
after the step's ``write_from``) read their 2r (CSA, previous window's Ca + own Cb) or r (HCA)
source rows from the same kind of pool over the compressor's ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deepinfer.engine.batch import ForwardBatch
from deepinfer.kernels import ops

NEG_INF = float("-inf")


class BatchError(ValueError):
    """A ForwardBatch the model cannot run; the message names the step and the problem."""


@dataclass(slots=True)
class TokenGroup:
    """Tokens whose compressed key set has the same size ``num_candidates``."""

    token_index: torch.Tensor | None  # [G] rows of the flat batch; None = all tokens in order
    num_candidates: int  # B; 0 = no compressed keys
    cand_rows: torch.Tensor | None = None  # [G, B] flat block-cache rows of entries 0..B-1
    cand_valid: torch.Tensor | None = None  # [G, B] bool: entry closed before the token
    cand_bias: torch.Tensor | None = None  # [G, 1, B] float32 0 / -inf


@dataclass(slots=True)
class EntryPlan:
    """Compressed entries that close in this forward, for one (ratio, overlap) kind."""

    ring_rows: torch.Tensor  # [R] ring rows gathered in front of the fresh rows
    src_index: torch.Tensor  # [E, span] rows of pool = cat(ring[ring_rows], fresh)
    src_valid: torch.Tensor  # [E, span] bool
    cos: torch.Tensor  # [E, rope/2] compress rope at the window's first position
    sin: torch.Tensor
    dst_rows: torch.Tensor  # [E] flat block-cache rows


@dataclass(slots=True)
class RingWrite:
    rows: torch.Tensor  # flat ring rows
    src: torch.Tensor  # token indices of the fresh rows


@dataclass(slots=True)
class CompressPlan:
    ratio: int
    overlap: bool
    span: int  # source rows per entry: 2r with overlap, else r
    capacity: int  # ring capacity: span + lookahead
    entries: EntryPlan | None  # None: no window closes in this forward
    ring_write: RingWrite
    groups: list[TokenGroup]


@dataclass(slots=True)
class WindowPlan:
    ring_rows: torch.Tensor  # [S * (W-1)]
    key_index: torch.Tensor  # [T, W] rows of pool = cat(ring[ring_rows], fresh)
    key_bias: torch.Tensor  # [T, 1, W] float32 0 / -inf
    ring_write: RingWrite
    groups: list[TokenGroup]  # token chunks bounded for memory (num_candidates 0)


@dataclass(slots=True)
class ForwardContext:
    num_tokens: int
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main"/"compress" -> cos, sin [T, rope/2]
    window: WindowPlan
    compress: dict[tuple[int, bool], CompressPlan]
    logit_index: torch.Tensor  # [num_logits]
    batch_invariant: bool
    extras: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Static shapes the metadata depends on (model + cache configuration)."""

    sliding_window: int
    window_capacity: int  # W + lookahead
    block_size: int
    lookahead: int
    vocab_size: int
    compress_kinds: tuple[tuple[int, bool], ...]  # distinct (ratio, overlap) of compressed layers
    inv_freq: dict[str, torch.Tensor]  # "main", "compress"
    max_group_key_rows: int = 1 << 17  # bound on G * (W + B) rows gathered at once


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


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rope_cos_sin(positions, inv_freq)


def _chunks(index: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
    return list(index.split(max(1, max_rows)))


def validate(batch: ForwardBatch, geo: Geometry, num_slots: int) -> None:
    if not batch.steps:
        raise BatchError("ForwardBatch has no steps")
    seen_seq, seen_slot = set(), set()
    min_ratio = min((r for r, _ in geo.compress_kinds), default=0)
    for i, s in enumerate(batch.steps):
        where = f"step {i} (seq {s.seq_id})"
        if s.seq_id in seen_seq:
            raise BatchError(f"{where}: a sequence may appear only once per forward")
        if s.slot in seen_slot or not 0 <= s.slot < num_slots:
            raise BatchError(f"{where}: slot {s.slot} is duplicated or out of range [0, {num_slots})")
        seen_seq.add(s.seq_id)
        seen_slot.add(s.slot)
        if s.num_tokens < 1 or s.start_pos < 0:
            raise BatchError(f"{where}: needs >= 1 token and start_pos >= 0")
        if not 0 <= s.num_logits <= s.num_tokens:
            raise BatchError(f"{where}: num_logits {s.num_logits} not in [0, {s.num_tokens}]")
        if s.window_start < 0 or s.window_start > s.start_pos or (s.window_start and s.window_start > s.write_from):
            raise BatchError(
                f"{where}: window_start {s.window_start} must be in [0, start_pos {s.start_pos}] "
                f"and <= write_from {s.write_from}"
            )
        if min(s.token_ids) < 0 or max(s.token_ids) >= geo.vocab_size:
            raise BatchError(f"{where}: token ids must be in [0, {geo.vocab_size})")
        if min_ratio:
            closed = (s.end_pos // min_ratio) * min_ratio
            need = -(-closed // geo.block_size)
            if len(s.block_table) < need:
                raise BatchError(f"{where}: block table has {len(s.block_table)} blocks, positions < {s.end_pos} need {need}")


def build_context(
    batch: ForwardBatch, geo: Geometry, *, device: torch.device, batch_invariant: bool
) -> ForwardContext:
    steps = batch.steps
    num_steps = len(steps)
    lengths = [s.num_tokens for s in steps]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    num_tokens = offsets[-1]

    token_ids = torch.tensor([t for s in steps for t in s.token_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in steps])
    tok_step = torch.repeat_interleave(torch.arange(num_steps), torch.tensor(lengths))
    starts = torch.tensor([s.start_pos for s in steps])
    slots = torch.tensor([s.slot for s in steps])
    window_floor = torch.tensor([max(0, s.window_start) for s in steps])
    max_blocks = max(1, max(len(s.block_table) for s in steps))
    tables = torch.zeros(num_steps, max_blocks, dtype=torch.long)
    for i, s in enumerate(steps):
        if len(s.block_table):
            tables[i, : len(s.block_table)] = torch.as_tensor(list(s.block_table), dtype=torch.long)
    table_len = torch.tensor([max(1, len(s.block_table)) for s in steps])

    window = _window_plan(steps, offsets, positions, tok_step, starts, slots, window_floor, geo)
    compress = {
        kind: _compress_plan(kind, steps, offsets, positions, tok_step, tables, table_len, geo)
        for kind in geo.compress_kinds
    }
    logit_index = torch.cat(
        [torch.arange(offsets[i + 1] - s.num_logits, offsets[i + 1]) for i, s in enumerate(steps)]
    )
    rope = {name: _cos_sin(positions, f) for name, f in geo.inv_freq.items()}
    ctx = ForwardContext(
        num_tokens=num_tokens,
        token_ids=token_ids,
        positions=positions,
        rope=rope,
        window=window,
        compress=compress,
        logit_index=logit_index,
        batch_invariant=batch_invariant,
    )
    return _to_device(ctx, device) if torch.device(device).type != "cpu" else ctx


def _ring_write(steps, offsets, capacity: int) -> RingWrite:
    rows, src = [], []
    for i, s in enumerate(steps):
        first = max(s.start_pos, s.end_pos - capacity)
        pos = torch.arange(first, s.end_pos)
        rows.append(s.slot * capacity + pos % capacity)
        src.append(offsets[i] + pos - s.start_pos)
    return RingWrite(rows=torch.cat(rows), src=torch.cat(src))


def _window_plan(steps, offsets, positions, tok_step, starts, slots, window_floor, geo: Geometry) -> WindowPlan:
    w, cap = geo.sliding_window, geo.window_capacity
    num_steps, num_tokens = len(steps), len(positions)
    back = torch.arange(-(w - 1), 0)  # the W-1 positions before a step's first one
    ring_pos = starts[:, None] + back[None, :]  # [S, W-1]
    ring_rows = (slots[:, None] * cap + ring_pos.remainder(cap)).reshape(-1)

    key_pos = positions[:, None] + torch.arange(-(w - 1), 1)[None, :]  # [T, W]
    step_start = starts[tok_step][:, None]
    from_ring = key_pos < step_start
    ring_index = tok_step[:, None] * (w - 1) + (key_pos - (step_start - (w - 1)))
    token_row = torch.arange(num_tokens)[:, None]
    fresh_index = num_steps * (w - 1) + token_row - (positions[:, None] - key_pos)
    key_index = torch.where(from_ring, ring_index, fresh_index)
    valid = key_pos >= window_floor[tok_step][:, None]
    key_bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, NEG_INF)[:, None, :]
    max_rows = geo.max_group_key_rows // w
    groups = (
        [TokenGroup(None, 0)]
        if num_tokens <= max_rows
        else [TokenGroup(idx, 0) for idx in _chunks(torch.arange(num_tokens), max_rows)]
    )
    return WindowPlan(
        ring_rows=ring_rows,
        key_index=key_index,
        key_bias=key_bias,
        ring_write=_ring_write(steps, offsets, cap),
        groups=groups,
    )


def _compress_plan(kind, steps, offsets, positions, tok_step, tables, table_len, geo: Geometry) -> CompressPlan:
    ratio, overlap = kind
    span = 2 * ratio if overlap else ratio
    cap = span + geo.lookahead
    rows_per_block = geo.block_size // ratio
    return CompressPlan(
        ratio=ratio,
        overlap=overlap,
        span=span,
        capacity=cap,
        entries=_entry_plan(ratio, span, cap, rows_per_block, steps, offsets, geo),
        ring_write=_ring_write(steps, offsets, cap),
        groups=_token_groups(ratio, rows_per_block, positions, tok_step, tables, table_len, geo),
    )


def _entry_plan(ratio, span, cap, rows_per_block, steps, offsets, geo: Geometry) -> EntryPlan | None:
    # pass 1: which windows close in each step (not those starting below write_from)
    closing = []
    for i, s in enumerate(steps):
        first = max(s.start_pos // ratio, -(-s.write_from // ratio))
        last = s.end_pos // ratio  # exclusive: windows whose last source position is < end_pos
        if last > first:
            closing.append((i, s, torch.arange(first, last)))
    if not closing:
        return None
    num_ring = len(closing) * (span - 1)  # the pool's fresh rows start here
    j = torch.arange(span)
    ring_rows, src_index, src_valid, entry_pos, dst_rows = [], [], [], [], []
    for k, (i, s, w) in enumerate(closing):
        ring_first = s.start_pos - (span - 1)
        ring_rows.append(s.slot * cap + torch.arange(ring_first, s.start_pos).remainder(cap))
        src_pos = w[:, None] * ratio - (span - ratio) + j[None, :]  # [E_i, span]
        ring_idx = k * (span - 1) + (src_pos - ring_first)
        fresh_idx = num_ring + offsets[i] + (src_pos - s.start_pos)
        src_index.append(torch.where(src_pos < s.start_pos, ring_idx, fresh_idx))
        src_valid.append(src_pos >= max(0, s.window_start))
        entry_pos.append(w * ratio)
        table = torch.as_tensor(list(s.block_table), dtype=torch.long)
        dst_rows.append(table[(w * ratio) // geo.block_size] * rows_per_block + w % rows_per_block)
    cos, sin = _cos_sin(torch.cat(entry_pos), geo.inv_freq["compress"])
    return EntryPlan(
        ring_rows=torch.cat(ring_rows),
        src_index=torch.cat(src_index),
        src_valid=torch.cat(src_valid),
        cos=cos,
        sin=sin,
        dst_rows=torch.cat(dst_rows),
    )


def _token_groups(ratio, rows_per_block, positions, tok_step, tables, table_len, geo: Geometry) -> list[TokenGroup]:
    num_entries = (positions + 1) // ratio  # entries closed at or before each token
    buckets = _buckets(num_entries)
    groups: list[TokenGroup] = []
    distinct = torch.unique(buckets).tolist()
    for b in distinct:
        idx = torch.nonzero(buckets == b).flatten()
        max_rows = geo.max_group_key_rows // (geo.sliding_window + b)
        whole = len(distinct) == 1 and len(idx) <= max_rows
        for part in [idx] if whole else _chunks(idx, max_rows):
            token_index = None if whole else part
            if b == 0:
                groups.append(TokenGroup(token_index, 0))
                continue
            w = torch.arange(b)
            logical = ((w * ratio) // geo.block_size)[None, :]
            step = tok_step[part][:, None]
            logical = torch.minimum(logical, table_len[step] - 1)  # padded candidates stay in range
            rows = tables[step, logical] * rows_per_block + (w % rows_per_block)[None, :]
            valid = w[None, :] < num_entries[part][:, None]
            bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, NEG_INF)[:, None, :]
            groups.append(TokenGroup(token_index, b, rows, valid, bias))
    return groups


def _to_device(ctx: ForwardContext, device: torch.device) -> ForwardContext:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True)
        if isinstance(x, (TokenGroup, EntryPlan, RingWrite, CompressPlan, WindowPlan)):
            for f in x.__slots__:
                setattr(x, f, move(getattr(x, f)))
            return x
        if isinstance(x, list):
            return [move(v) for v in x]
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    for f in ("token_ids", "positions", "rope", "window", "compress", "logit_index"):
        setattr(ctx, f, move(getattr(ctx, f)))
    return ctx
