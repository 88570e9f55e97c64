"""The wire layout of one MoE layer's dispatch and combine (planned on the host).

A home rank sends each token once per rank that holds one of its experts, with the local slots
of those experts at that rank riding in k extra columns (exact small integers in the row's
dtype; -1 for "not here"):

    send rows:  | rank 0: its tokens, ascending | rank 1: ... | ... |      each row [x (H) | slots (k)]
                  token t's row for rank r:  x[t], slot of pair (t, j) at r in column j, else -1

The expert rank turns its received rows into pairs in (row, column) order, computes them grouped
by slot and sends one output row per pair back in that same order. Rows from rank q are
contiguous and in token order, so what comes back from rank r is exactly the home rank's pairs
on r in pair order: the combine buffer is the pairs sorted stably by destination rank, and
``row_of_pair`` says where each pair's output landed. Nothing is summed on the expert side: the
home rank adds a token's k outputs in slot order, as the single-process MoE does, so results do
not depend on the rank count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_EXACT_SLOT = {torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


@dataclass(slots=True)
class DispatchLayout:
    """What one home rank sends for one layer."""

    row_token: torch.Tensor  # [R] token of each sent row (by destination rank, then token)
    slot_cols: torch.Tensor  # [R, k] float32 local slot of the row's pair j at its rank, -1 if none
    rows_per_rank: list[int]  # [ranks] rows sent to each rank
    pairs_per_rank: list[int]  # [ranks] pairs computed by each rank (= rows it sends back)
    row_of_pair: torch.Tensor  # [T * k] row of pair (t * k + j)'s output in the combine buffer


def plan_dispatch(dest: np.ndarray, local_slot: np.ndarray, num_tokens: int, top_k: int,
                  num_ranks: int) -> DispatchLayout:
    """dest, local_slot: [T * k] the rank and its local slot serving each pair."""
    num_pairs = num_tokens * top_k
    assert dest.shape == (num_pairs,) and local_slot.shape == (num_pairs,)
    pair_token = np.arange(num_pairs) // top_k
    key = dest * max(num_tokens, 1) + pair_token  # one row per (rank, token), sorted by rank then token
    rows, row_of_key = np.unique(key, return_inverse=True)
    row_dest = rows // max(num_tokens, 1)
    slot_cols = np.full((rows.shape[0], top_k), -1.0, dtype=np.float32)
    slot_cols[row_of_key, np.arange(num_pairs) % top_k] = local_slot
    by_dest = np.argsort(dest, kind="stable")  # combine buffer order: pairs by rank, pair order within
    row_of_pair = np.empty(num_pairs, dtype=np.int64)
    row_of_pair[by_dest] = np.arange(num_pairs)
    return DispatchLayout(
        row_token=torch.from_numpy(rows % max(num_tokens, 1)),
        slot_cols=torch.from_numpy(slot_cols),
        rows_per_rank=np.bincount(row_dest, minlength=num_ranks).tolist(),
        pairs_per_rank=np.bincount(dest, minlength=num_ranks).tolist(),
        row_of_pair=torch.from_numpy(row_of_pair),
    )


def pack_rows(x: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """The send buffer [R, H + k] for the first tokens of ``x [T, H]``."""
    index = layout.row_token.to(x.device)
    return torch.cat([x.index_select(0, index), layout.slot_cols.to(device=x.device, dtype=x.dtype)], dim=1)


@dataclass(slots=True)
class ReceivedPairs:
    """An expert rank's work for one layer: the rows it got and its pairs over them."""

    x: torch.Tensor  # [rows, H] contiguous
    pair_row: torch.Tensor  # [pairs] received row of each pair, (row, column) order
    pair_slot: np.ndarray  # [pairs] local slot of each pair
    pairs_from_rank: list[int]  # [ranks] pairs from each home rank (= rows to send it back)


def unpack_rows(recv: torch.Tensor, rows_from_rank: list[int], hidden: int) -> ReceivedPairs:
    """recv [rows, H + k] as sent by ``pack_rows`` from every rank, rank by rank."""
    slots = recv[:, hidden:].to(torch.float32).cpu().numpy()
    row, col = np.nonzero(slots >= 0)  # row-major: (row, column) order
    pair_slot = slots[row, col].astype(np.int64)
    edges = np.cumsum([0, *rows_from_rank])
    per_rank = np.diff(np.searchsorted(row, edges)).tolist()  # rows of rank q are [edges[q], edges[q+1])
    return ReceivedPairs(
        x=recv[:, :hidden].contiguous(),
        pair_row=torch.from_numpy(row.astype(np.int64)).to(recv.device),
        pair_slot=pair_slot,
        pairs_from_rank=per_rank,
    )


def check_slot_range(slots_per_rank: int, dtype: torch.dtype) -> None:
    """Slot ids ride in the rows' dtype: they must be exact there."""
    limit = MAX_EXACT_SLOT.get(dtype)
    if limit is None or slots_per_rank > limit:
        raise ValueError(f"{slots_per_rank} expert slots per rank cannot ride exactly in {dtype} rows; "
                         "use float32 or fewer slots per rank")
