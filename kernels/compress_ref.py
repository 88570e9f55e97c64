"""Torch reference of the gated compressor's pooling (``torch_ref.compress_pool`` adds the norm).

An entry pools ``span`` source rows of ``pool = cat(ring[ring_rows], fresh)``; with ``overlap``
(CSA) the source rows are ``2 * head_dim`` wide and the slots take different halves:

    slot j    0 .. r-1                     r .. 2r-1
    channels  row[:head_dim] (Ca, w - 1)   row[head_dim:] (Cb, w)
    bias row  position_bias[j, :head_dim]  position_bias[j - r, head_dim:]

Without overlap every slot takes the whole row and ``position_bias[j]``.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def compress_pooled(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_gate: torch.Tensor,
    ring_rows: torch.Tensor,
    src_index: torch.Tensor,
    src_valid: torch.Tensor,
    position_bias: torch.Tensor | None,
    ratio: int,
    head_dim: int,
    overlap: bool,
) -> torch.Tensor:
    """Gated pooling ``sum_j softmax_j(gate_j + bias_j) * kv_j`` ``[E, head_dim]`` in kv's dtype.

    ``kv``/``gate [T, width]`` fresh rows, ``ring_kv``/``ring_gate [R, width]`` the flat rings,
    ``ring_rows [N]`` the ring rows in front of the fresh ones, ``src_index [E, span]`` rows of the
    pool, ``src_valid [E, span]`` bool (invalid slots get weight 0; an entry with none valid is
    NaN, as torch's softmax of all -inf), ``position_bias [ratio, width]`` float32 or None; width
    is ``2 * head_dim`` with ``overlap`` (span ``2 * ratio``), else ``head_dim`` (span ``ratio``
    with a bias). Rounding: softmax in float32, weights and products in kv's dtype, the sum
    accumulated in float32 and rounded to kv's dtype (torch's sum of a bf16 tensor).
    """
    num_entries, span = src_index.shape
    width = kv.shape[-1]
    r, d, bias = ratio, head_dim, position_bias
    pool_kv = torch.cat([ring_kv.index_select(0, ring_rows), kv])
    pool_gate = torch.cat([ring_gate.index_select(0, ring_rows), gate])
    flat_index = src_index.reshape(-1)
    src_kv = pool_kv.index_select(0, flat_index).view(num_entries, span, width)
    src_gate = pool_gate.index_select(0, flat_index).view(num_entries, span, width).float()
    if overlap:
        src_kv = torch.cat([src_kv[:, :r, :d], src_kv[:, r:, d:]], dim=1)
        early, late = src_gate[:, :r, :d], src_gate[:, r:, d:]
        if bias is not None:
            early, late = early + bias[:, :d], late + bias[:, d:]
        src_gate = torch.cat([early, late], dim=1)
    elif bias is not None:
        src_gate = src_gate + bias
    src_gate = src_gate.masked_fill(~src_valid[..., None], NEG_INF)
    weights = src_gate.softmax(dim=1).to(src_kv.dtype)
    return (src_kv * weights).sum(dim=1)
