"""Gated compressors (CSA with overlap, HCA without) and the CSA lightning indexer.

A compressor turns every ``ratio`` source tokens into one entry:

    entry w = kv_norm( sum_j softmax_j(gate_j + position_bias_j) * kv_j )   rotated at w * ratio

HCA pools the r rows of window w. CSA projects two series per token (Ca = first half, Cb =
second half) and pools 2r slots: Ca of window w-1 and Cb of window w (stride r, width 2r); for
w = 0 the Ca slots are absent. The source rows of windows still open live in the SWA slot's
rings (``comp_kv``/``comp_gate``, ``index_kv``/``index_gate``); closed entries go to the paged
block cache (``compressed``, ``indexer_keys``).

The indexer scores compressed entries per query with ``sum_h w_h * relu(q_h . k)`` and keeps the
top ``index_topk`` closed ones for the CSA attention.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.models.deepseek_v4.context import EntryPlan, TokenGroup
from deepinfer.engine.models.deepseek_v4.layers import Norm, linear_holder
from deepinfer.kernels import ops


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float, device=None, dtype=None,
                 *, position_bias: bool = True, gated: bool = True):
        """``position_bias``/``gated`` False: no learned per-slot bias / no gate (V4.1's compressors
        have no bias, and its ratio-1 one is a plain projection: ``gated`` needs ``ratio == 1``)."""
        super().__init__()
        if not gated and (ratio != 1 or overlap):
            raise ValueError(f"an ungated compressor pools nothing: it needs ratio 1 without overlap, got {ratio}")
        self.head_dim, self.ratio, self.overlap, self.eps = head_dim, ratio, overlap, eps
        width = 2 * head_dim if overlap else head_dim  # projected features per source token
        self.width = width
        self.kv_proj = linear_holder(hidden_size, width, device, dtype)
        self.gate_proj = linear_holder(hidden_size, width, device, dtype) if gated else None
        self.position_bias = None
        if position_bias:
            self.position_bias = nn.Parameter(
                torch.empty(ratio, width, device=device, dtype=torch.float32), requires_grad=False
            )
        self.kv_norm = Norm(head_dim, device)

    def input_linears(self) -> list[nn.Linear]:
        return [self.kv_proj] if self.gate_proj is None else [self.kv_proj, self.gate_proj]

    def close_entries(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ring_kv: torch.Tensor,
        ring_gate: torch.Tensor,
        plan: EntryPlan,
    ) -> torch.Tensor:
        """Entries ``[E, head_dim]`` of the windows that close in this forward.

        ``kv``/``gate [T, width]`` are this forward's projections; ``ring_*`` the flat rings
        holding earlier positions. Sources come from ``pool = cat(ring rows, fresh rows)``.
        """
        return ops.apply_rope_(self.pool_entries(kv, gate, ring_kv, ring_gate, plan), plan.cos, plan.sin)

    def pool_entries(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor | None,
        ring_kv: torch.Tensor | None,
        ring_gate: torch.Tensor | None,
        plan: EntryPlan,
    ) -> torch.Tensor:
        """``close_entries`` before the rotation: the normed pooled latent ``[E, head_dim]``
        (V4.1's indexer keys are projected from it). A gated compressor pools through
        ``ops.compress_pool`` (one kernel on a GPU); an ungated one takes its one row."""
        if self.gate_proj is None:
            return ops.rms_norm(kv.index_select(0, plan.src_index.reshape(-1) - plan.ring_rows.numel()),
                                self.kv_norm.weight, self.eps)
        return ops.compress_pool(kv, gate, ring_kv, ring_gate, plan.ring_rows, plan.src_index, plan.src_valid,
                                 self.position_bias, self.ratio, self.head_dim, self.overlap, self.kv_norm.weight,
                                 self.eps)


class Scorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        self.weights_proj = linear_holder(hidden_size, num_heads, device, dtype)


class Indexer(Compressor):
    """CSA lightning indexer: its own overlapping compressor at ``index_head_dim`` plus scoring."""

    def __init__(self, hidden_size, q_lora_rank, num_heads, head_dim, ratio, top_k, eps, device=None, dtype=None):
        super().__init__(hidden_size, head_dim, ratio, True, eps, device, dtype)
        self.num_heads, self.top_k = num_heads, top_k
        self.q_b_proj = linear_holder(q_lora_rank, num_heads * head_dim, device, dtype)
        self.scorer = Scorer(hidden_size, num_heads, device, dtype)

    def input_linears(self) -> list[nn.Linear]:
        return [self.kv_proj, self.gate_proj, self.scorer.weights_proj]

    def select(
        self,
        q: torch.Tensor,
        head_weights: torch.Tensor,
        keys: torch.Tensor,
        group: TokenGroup,
        batch_invariant: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k closed entries per token: (flat block-cache rows [G, k], bias [G, 1, k]).

        ``q [G, H, Di]`` (rotated), ``head_weights [G, H]`` float32, ``keys [G, B, Di]`` the
        candidates of ``group``. Candidates never closed score -inf and, if picked because a
        token has fewer than k closed entries, are masked out of the attention.
        """
        total = index_scores(q, head_weights, keys, group, batch_invariant)
        return top_entries(total, group, self.top_k)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, group: TokenGroup,
                 batch_invariant: bool) -> torch.Tensor:
    """``sum_h w_h * relu(q_h . k) / sqrt(Di)`` per candidate ``[G, B]`` float32, -inf where the
    candidate never closed before the token (shapes as in ``Indexer.select``)."""
    return ops.index_scores(q, head_weights, keys, group.cand_valid, batch_invariant)


def top_entries(total: torch.Tensor, group: TokenGroup, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` best-scoring candidates of ``total [G, B]``: (flat block-cache rows [G, k],
    attention bias [G, 1, k]: 0, or -inf for candidates never closed)."""
    k = min(top_k, group.num_candidates)
    # topk works row by row: the same scores give the same picks in the same order
    picked = torch.topk(total, k, dim=-1).indices
    bias = group.cand_bias[:, 0, :].gather(1, picked)  # 0, or -inf for entries never closed
    return group.cand_rows.gather(1, picked), bias[:, None, :]
