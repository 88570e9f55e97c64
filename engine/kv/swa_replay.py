"""How the SWA state of a prefix hit is rebuilt: restore a slot, or replay (exact / bounded).

Pure functions over plain values (no torch): the scheduler hook, the slot manager and the
benchmark share them.

A hit of ``h`` tokens (block-aligned) reuses the block cache below ``h`` untouched; the sliding-
window state at ``h`` must come from somewhere::

    positions:  0 ............................. h-R ......... h | h ... (new tokens)
                |--- block cache (compressed rows, read only) ---|
                                                |-- replayed --|   window_start = h - R
                                                                   write_from   = h

- slot: a stored slot at boundary ``h`` (local or fetched) is written into the sequence's
  SWA slot; nothing is replayed (``R = 0``, ``window_start = 0``).
- exact replay: ``R = min(h, sliding_window * num_layers)``. Layer l's window output at p depends
  on layer l-1 over ``[p - W + 1, p]``, so after ``L * W`` replayed positions every layer's rows
  equal those of a full prefill: the state is exact.
- bounded replay: ``R = min(h, replay_tokens)`` (default 128): constant cost whatever ``h`` is; the
  windows are truncated to the replayed segment, so the state is approximate. It is used for
  decoding only: blocks this sequence computes past ``h`` never enter the prefix cache and its
  state is never saved as a slot (ARCHITECTURE.md, "Caches").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SwaReplayMode = Literal["exact", "bounded"]
SWA_REPLAY_MODES = ("exact", "bounded")
DEFAULT_REPLAY_TOKENS = 128


def exact_replay_tokens(sliding_window: int, num_layers: int) -> int:
    """Replayed tokens that rebuild every layer's window exactly."""
    return sliding_window * num_layers


def check_mode(mode: str, replay_tokens: int) -> None:
    if mode not in SWA_REPLAY_MODES:
        raise ValueError(f"swa_replay must be 'exact' or 'bounded', got {mode!r}")
    if replay_tokens < 1:
        raise ValueError(f"replay_tokens must be >= 1, got {replay_tokens}")


def max_replay_tokens(mode: SwaReplayMode, *, sliding_window: int, num_layers: int,
                      replay_tokens: int = DEFAULT_REPLAY_TOKENS) -> int:
    """The scheduler's ``max_replay_tokens`` for a mode."""
    check_mode(mode, replay_tokens)
    exact = exact_replay_tokens(sliding_window, num_layers)
    return exact if mode == "exact" else min(replay_tokens, exact)


def is_approximate(window_start: int, write_from: int, num_exact_tokens: int) -> bool:
    """Whether a sequence rebuilt by replaying ``[window_start, write_from)`` has an inexact window
    state (a replay that starts at 0 or covers the exact span is exact)."""
    return window_start > 0 and write_from - window_start < num_exact_tokens


def snapshot_boundary(end_pos: int, num_known: int, block_size: int, lookahead: int) -> int | None:
    """The block boundary whose state a sequence's slot holds right after a forward that ended
    at ``end_pos``, or None.

    Rings are position-addressed with ``lookahead`` spare rows, so the slot after computing up to
    ``end_pos`` is also the exact state at any ``B`` with ``end_pos - lookahead <= B <= end_pos``
    (the rollback rule, cache/swa_state.py). ``num_known``: positions below it hold accepted
    tokens (drafts of a verify step are above it).
    """
    boundary = (min(end_pos, num_known) // block_size) * block_size
    if boundary == 0 or end_pos - boundary > lookahead:
        return None
    return boundary


def snapshot_chunk_end(start: int, end: int, num_known: int, block_size: int, lookahead: int) -> int:
    """Where a chunk ``[start, end)`` should end so that the state at ``B``, the last block
    boundary of the ``num_known`` known tokens, can be snapshotted: at ``B`` when the chunk
    crosses it and would end more than ``lookahead`` past it (its rings would no longer hold
    ``B``'s window), else at ``end``. The tail ``[B, end)`` runs in the next step.

    Without the cut a prompt's slot exists only when its length lands within ``lookahead`` of a
    boundary; with it, the next turn (whose prefix hit ends at ``B``) restores instead of replaying."""
    boundary = (num_known // block_size) * block_size
    if start < boundary < end and end - boundary > lookahead:
        return boundary
    return end


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    num_replay_tokens: int
    window_start: int
    write_from: int
    is_restored: bool  # from a slot: nothing replayed


def plan_rebuild(hit_len: int, *, has_slot: bool, max_replay: int | None) -> RebuildPlan:
    """What the scheduler does at admission for a hit of ``hit_len`` tokens."""
    if has_slot and hit_len > 0:
        return RebuildPlan(0, 0, hit_len, True)
    num_replay = hit_len if max_replay is None else min(hit_len, max_replay)
    start = hit_len - num_replay
    return RebuildPlan(num_replay, start, hit_len, False)


@dataclass(frozen=True, slots=True)
class FlopModel:
    """Forward FLOPs of one replayed token, from the model's shapes (multiply-adds x 2).

    ``dense_flops_per_token``: projections, MoE (active experts + shared) and the head-free
    trunk; attention adds ``4 * heads * head_dim`` per key a query reads (scores + values).
    """

    dense_flops_per_token: float
    attn_flops_per_key: float  # per layer, summed over layers below
    num_layers: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # per layer (0: window only)
    index_topk: int

    def replay_flops(self, hit_len: int, num_replay: int) -> float:
        """FLOPs of replaying ``[hit_len - num_replay, hit_len)`` with windows truncated there."""
        total = self.dense_flops_per_token * num_replay
        for ratio in self.compress_ratios:
            for_keys = 0.0
            # window keys: a replayed query at offset i reads min(i + 1, W) rows
            w = self.sliding_window
            full = max(0, num_replay - w)
            for_keys += full * w + min(num_replay, w) * (min(num_replay, w) + 1) / 2
            if ratio:
                # compressed keys: all entries below the query (capped by the indexer's top-k on CSA)
                num_entries = hit_len // ratio
                for_keys += num_replay * (min(num_entries, self.index_topk) if ratio <= 4 else num_entries)
            total += self.attn_flops_per_key * for_keys
        return total


def flop_model(config) -> FlopModel:
    """``FlopModel`` of a ``ModelConfig`` (the fields every V4 config has)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    heads = c.num_attention_heads
    attn_proj = h * c.q_lora_rank + c.q_lora_rank * heads * d + h * d  # wq_a, wq_b, wkv
    attn_proj += heads * d * c.o_lora_rank + c.o_groups * c.o_lora_rank * h  # grouped wo_a (per group), wo_b
    moe = 3 * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts) + h * c.n_routed_experts
    dense = 2.0 * c.num_hidden_layers * (attn_proj + moe)
    return FlopModel(dense, 4.0 * heads * d, c.num_hidden_layers, c.sliding_window, c.compress_ratios, c.index_topk)
