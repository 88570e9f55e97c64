"""Per-forward index metadata for DeepSeek-V4: built once from a ForwardBatch, shared by all layers.

Tokens of all steps are flattened in step order (T tokens). Every token attends to a key set of
a size that depends only on its own position t, never on the batch or the chunking:

  window part   L(t) = min(W, 32 * ceil((t+1) / 32)) rows for positions t-L+1 .. t (masked
                below max(0, window_start)), then one zero row standing for the sink
  compressed    B candidate entries 0 .. B-1 of the layer's ratio r, B = bucket((t+1) // r),
                masked at w >= (t+1) // r (HCA attends all of them, CSA scores them with the
                indexer and attends its top-k)

Tokens with equal (L, B) form a ``TokenGroup`` computed by one set of batched ops.

Row-wise work runs on R = gemm_rows(T) >= T rows in batch-invariant mode (padding rows at the
end, never attended to or attending), so every GEMM takes the same kernel without padding each
call. Window rows come from a per-layer *pool*: for each step the W-1 ring rows before its
first position, then the R freshly computed rows, then one zero row (the sink):

    pool = [ring rows of step 0 (W-1) | ... | step S-1 (W-1) | fresh rows (R) | zero row]

Compressed entries that close in this forward (windows ending inside a step, starting at or
after the step's ``write_from``) read their 2r (CSA, previous window's Ca + own Cb) or r (HCA)
source rows from the same kind of pool over the compressor's ring (index_plans.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.kernels.torch_ref import gemm_rows

NEG_INF = float("-inf")
WINDOW_GRANULE = 32  # window key sets grow in steps of this many rows up to the full window


class BatchError(ValueError):
    """A ForwardBatch the model cannot run; the message names the step and the problem."""


@dataclass(slots=True)
class TokenGroup:
    """Tokens whose key set has the same shape: ``window_len`` rows + sink + ``num_candidates``."""

    token_index: torch.Tensor | None  # [G] rows of the flat batch; None = rows 0..T-1
    window_len: int  # L
    win_index: torch.Tensor | None  # [G * (L + 1)] pool rows: window rows then the sink row
    win_bias: torch.Tensor | None  # [G, 1, L + 1] float32 0 / -inf
    num_candidates: int = 0  # B; 0 = no compressed keys
    cand_rows: torch.Tensor | None = None  # [G, B] flat block-cache rows of entries 0..B-1
    cand_valid: torch.Tensor | None = None  # [G, B] bool: entry closed before the token
    cand_bias: torch.Tensor | None = None  # [G, 1, B] float32 0 / -inf
    # compact form (``Geometry.compact_candidates``): cand_rows may be [1, B] (every token of the
    # group reads the same step's table) and the per-token count of closed entries replaces
    # cand_valid / cand_bias until ``expand_candidates`` builds them where the context lives
    cand_count: torch.Tensor | None = None  # [G] int64, <= B
    # compact window (the same flag): row j < L of a token is ``ring + j`` below ``split``, else
    # ``fresh + j``; row L the sink row; the first ``masked`` rows are masked. ``win_plan`` [G, 4]
    # int64 holds (fresh, ring, split, masked) per token and ``expand_window`` builds win_index /
    # win_bias from it where the context lives (12 (L + 1) bytes a token become 32)
    win_plan: torch.Tensor | None = None
    win_sink: int = 0
    # compact candidates of a group whose tokens belong to several steps: ``cand_table`` [S, B]
    # one row per distinct step and ``cand_step`` [G] each token's row of it (cand_rows None
    # until ``expand_candidates`` gathers them where the context lives)
    cand_table: torch.Tensor | None = None
    cand_step: torch.Tensor | None = None

    def expand_window(self) -> None:
        """Build win_index / win_bias from win_plan (on its device); a no-op in the full form.
        Rebuilt on every call, as ``expand_candidates`` (a CUDA graph must contain the launches)."""
        if self.win_plan is None:
            return
        plan, length = self.win_plan, self.window_len
        j = torch.arange(length + 1, device=plan.device)[None, :]
        fresh, ring, split, masked = (plan[:, i : i + 1] for i in range(4))
        rows = torch.where(j < split, ring + j, fresh + j)
        rows[:, length] = self.win_sink
        self.win_index = rows.reshape(-1)
        self.win_bias = torch.zeros(rows.shape, dtype=torch.float32, device=plan.device).masked_fill_(
            j < masked, NEG_INF)[:, None, :]

    def expand(self) -> None:
        """Both compact forms to the full one (``expand_window``, ``expand_candidates``)."""
        self.expand_window()
        self.expand_candidates()

    def expand_candidates(self) -> None:
        """Build cand_valid / cand_bias from cand_count (on its device) and view cand_rows as
        [G, B]; a no-op for a group in the full form. Rebuilt on every call, never kept from a
        previous one: a CUDA graph captured after a warm-up forward of the same context must
        contain these launches, so that a replay reads the counts packed for it."""
        if self.cand_count is None:
            return
        count = self.cand_count
        valid = torch.arange(self.num_candidates, device=count.device)[None, :] < count[:, None]
        self.cand_valid = valid
        self.cand_bias = torch.zeros(valid.shape, dtype=torch.float32, device=count.device).masked_fill_(
            ~valid, float("-inf"))[:, None, :]
        if self.cand_step is not None:
            self.cand_rows = self.cand_table.index_select(0, self.cand_step)
        elif self.cand_rows.shape[0] != count.shape[0]:
            self.cand_rows = self.cand_rows.expand(count.shape[0], -1)

    @property
    def shared_rows(self) -> bool:
        """Whether every token of the group reads the same candidate rows (one stored row)."""
        return self.cand_rows is not None and self.cand_rows.shape[0] > 1 and self.cand_rows.stride(0) == 0


@dataclass(slots=True)
class EntryPlan:
    """Compressed entries that close in this forward, for one (ratio, overlap) kind."""

    ring_rows: torch.Tensor  # ring rows gathered in front of the fresh rows
    src_index: torch.Tensor  # [E, span] rows of pool = cat(ring[ring_rows], fresh)
    src_valid: torch.Tensor  # [E, span] bool
    cos: torch.Tensor  # [E, rope_dim] compress rope tables at the window's first position
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
    ring_rows: torch.Tensor  # [S * (W-1)] ring rows in front of the pool
    ring_write: RingWrite
    groups: list[TokenGroup]  # for window-only layers (num_candidates 0)


@dataclass(slots=True)
class RopeRows:
    cos: torch.Tensor  # [R, rope_dim] tables of ops.rope_tables
    sin: torch.Tensor
    neg_sin: torch.Tensor  # un-rotates

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


@dataclass(slots=True)
class ForwardContext:
    num_tokens: int  # T real tokens
    num_rows: int  # R >= T rows of row-wise work (padding rows after the real ones)
    token_ids: torch.Tensor  # [R] (0 on padding rows)
    positions: torch.Tensor  # [R] (0 on padding rows)
    rope: dict[str, RopeRows]  # "main" / "compress"
    window: WindowPlan
    compress: dict[tuple[int, bool], CompressPlan]
    logit_index: torch.Tensor  # [num_logits]
    batch_invariant: bool


def expand_groups(ctx: ForwardContext) -> None:
    """Every token group of ``ctx`` (window and compressed plans) in the full form, built where
    the context lives (``TokenGroup.expand``): the first thing a forward does."""
    for g in ctx.window.groups:
        g.expand()
    for plan in ctx.compress.values():
        for g in plan.groups:
            g.expand()


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
    max_group_key_rows: int = 1 << 17  # bound on G * (L + 1 + B) key rows gathered at once
    # TokenGroup's compact candidates (a model off the CPU): a prefill chunk's [G, B] rows, valid
    # and bias (13 bytes a candidate, ~110 MB for 8K tokens at ratio 4) become [1, B] rows and [G]
    # counts, expanded on the device; and its window rows and bias ([G, L + 1] int64 and float32:
    # 138 MB of the 209 MB context of a 64 x 512-token prefill) a [G, 4] plan (``win_plan``)
    compact_candidates: bool = False
    # decode and verify forwards (every step at most this many tokens; 0: off): one token group
    # per layer kind, its window length and candidate bucket the batch's largest, each token's
    # own masked by its window plan's masked rows and its candidate count (``index_plans._grouped``).
    # Grouping by key-set shape made the groups, and so the CUDA-graph signature, change with
    # which tokens crossed a bucket at each step (most decode steps of 60 requests ran eagerly)
    merge_step_tokens: int = 0
    # >= 0 (a runner replaying CUDA graphs): the block cache's dump block, and decode / verify
    # forwards pad their closing entries (``cuda_graphs.shape_bucket`` sizes) with writes to it
    # (``index_plans._padded_entries``), so their shapes do not change with how many windows close
    dump_block: int = -1


MERGE_STEP_TOKENS = 16  # off the CPU: a step of up to 15 drafts + its root merges (Geometry.merge_step_tokens)


def merge_step_tokens(device: torch.device) -> int:
    """``Geometry.merge_step_tokens`` for a model on ``device``: off the CPU, where forwards replay
    CUDA graphs; the CPU keeps the tightest groups (no graphs, less masked work)."""
    return 0 if device.type == "cpu" else MERGE_STEP_TOKENS


def group_key_rows(device: torch.device) -> int:
    """``Geometry.max_group_key_rows`` for a model on ``device``. Off the CPU the attention
    kernel reads keys in place and only the indexer's keys are gathered (G * B rows of the
    index head dim: 256 MB at bf16 x 128), so groups are 8x larger: an 8K-token prefill runs
    about 8x fewer token groups (each a chain of small launches) per compressed layer."""
    return 1 << 17 if device.type == "cpu" else 1 << 20


@dataclass(slots=True)
class StepArrays:
    """The batch's steps as flat int64 numpy arrays (host), shared by the plan builders."""

    steps: list
    offsets: list[int]  # first flat token of each step, plus the total
    positions: np.ndarray  # [T]
    tok_step: np.ndarray  # [T] step of each token
    starts: np.ndarray  # [S]
    lengths: np.ndarray  # [S] tokens per step
    slots: np.ndarray  # [S]
    window_floor: np.ndarray  # [S] max(0, window_start)
    tables: np.ndarray  # [S, max blocks] zero-padded block tables
    table_len: np.ndarray  # [S] max(1, table length)
    num_rows: int
    write_from: np.ndarray  # [S]
    decode: bool  # every step has one token
    ring_steps: int = 0  # steps the per-step pools are laid out for (index_plans.padded_steps; >= S)
    window_cache: dict = field(default_factory=dict)  # per-forward memo of the plan builders


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


def build_context(batch: ForwardBatch, geo: Geometry, *, device: torch.device, batch_invariant: bool) -> ForwardContext:
    from deepinfer.engine.models.deepseek_v4.index_plans import compress_plan, padded_steps, rope_tables, window_plan

    steps = batch.steps
    num_steps = len(steps)
    lengths = np.fromiter((s.num_tokens for s in steps), dtype=np.int64, count=num_steps)
    offsets = [0, *np.cumsum(lengths).tolist()]
    num_tokens = offsets[-1]
    num_rows = gemm_rows(num_tokens) if batch_invariant else num_tokens
    table_lens = [len(s.block_table) for s in steps]
    max_blocks = max(1, max(table_lens))
    if all(n == max_blocks for n in table_lens):
        tables = np.array([s.block_table for s in steps], dtype=np.int64).reshape(num_steps, max_blocks)
    else:
        tables = np.zeros((num_steps, max_blocks), dtype=np.int64)
        for i, s in enumerate(steps):
            tables[i, : len(s.block_table)] = s.block_table
    starts = np.fromiter((s.start_pos for s in steps), dtype=np.int64, count=num_steps)
    decode = num_tokens == num_steps
    if decode:
        tok_step, positions = np.arange(num_steps), starts
    else:
        tok_step = np.repeat(np.arange(num_steps), lengths)
        positions = starts[tok_step] + (np.arange(num_tokens) - np.asarray(offsets[:-1])[tok_step])
    arrays = StepArrays(
        steps=steps,
        offsets=offsets,
        positions=positions,
        tok_step=tok_step,
        starts=starts,
        lengths=lengths,
        slots=np.fromiter((s.slot for s in steps), dtype=np.int64, count=num_steps),
        window_floor=np.fromiter((max(0, s.window_start) for s in steps), dtype=np.int64, count=num_steps),
        tables=tables,
        table_len=np.maximum(np.array(table_lens, dtype=np.int64), 1),
        num_rows=num_rows,
        write_from=np.fromiter((s.write_from for s in steps), dtype=np.int64, count=num_steps),
        decode=decode,
        ring_steps=padded_steps(lengths, geo),
    )
    pad = num_rows - num_tokens
    ids = [t for s in steps for t in s.token_ids]
    token_ids = torch.tensor(ids + [0] * pad if pad else ids, dtype=torch.long)
    row_positions = torch.from_numpy(np.concatenate([positions, np.zeros(pad, dtype=np.int64)]) if pad else positions.copy())
    logit_index = torch.tensor(
        [j for i, s in enumerate(steps) for j in range(offsets[i + 1] - s.num_logits, offsets[i + 1])], dtype=torch.long
    )
    rope = {}
    for name, f in geo.inv_freq.items():
        cos, sin = rope_tables(row_positions.numpy(), f)
        rope[name] = RopeRows(cos, sin, -sin)
    ctx = ForwardContext(
        num_tokens=num_tokens,
        num_rows=num_rows,
        token_ids=token_ids,
        positions=row_positions,
        rope=rope,
        window=window_plan(arrays, geo),
        compress={kind: compress_plan(kind, arrays, geo) for kind in geo.compress_kinds},
        logit_index=logit_index,
        batch_invariant=batch_invariant,
    )
    return _to_device(ctx, device) if torch.device(device).type != "cpu" else ctx


def _to_device(ctx: ForwardContext, device: torch.device) -> ForwardContext:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True)
        if isinstance(x, (TokenGroup, EntryPlan, RingWrite, CompressPlan, WindowPlan, RopeRows)):
            for f in x.__slots__:
                setattr(x, f, move(getattr(x, f)))
            return x
        if isinstance(x, list):
            return [move(v) for v in x]
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    for f in ("token_ids", "positions", "rope", "window", "compress", "logit_index"):
        setattr(ctx, f, move(getattr(ctx, f)))
    return ctx
