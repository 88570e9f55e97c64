"""Where each slot of a new placement gets its weights from: pure, computed alike on every rank.

One layer, ``num_ranks`` ranks of ``slots_per_rank`` slots; slot p lives on rank p // S as its
local slot p % S (the layout of ``placement``). A new slot holding expert e copies

* from the rank itself when the old placement already has e there (a local copy, no traffic),
* else from one of the ranks that held e, chosen by ``(rank + slot) mod holders`` so that a hot
  expert copied to many ranks is read from all of its holders, not one.

Every rank derives the same table from the same (old, new) rows, so the senders know what to send
without a message: rank q sends, to each rank r, the entries of r whose source is q, in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SlotSources:
    src_rank: np.ndarray  # [num_ranks, S] rank each new slot copies from
    src_slot: np.ndarray  # [num_ranks, S] local slot there

    def sends(self, src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
        """(source local slots, destination local slots) that rank ``src`` sends rank ``dst``,
        in destination slot order."""
        dst_slots = np.flatnonzero(self.src_rank[dst] == src)
        return self.src_slot[dst, dst_slots], dst_slots

    @property
    def num_remote(self) -> int:
        """Slots copied from another rank (the traffic of a re-placement)."""
        return int((self.src_rank != np.arange(self.src_rank.shape[0])[:, None]).sum())


def slot_sources(old: np.ndarray, new: np.ndarray, num_ranks: int) -> SlotSources:
    """old, new: [num_physical] phy2log rows of one layer -> the source of every new slot."""
    old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    assert old.shape == new.shape and old.ndim == 1 and old.shape[0] % num_ranks == 0, (
        f"placements {old.shape} / {new.shape} do not split over {num_ranks} ranks")
    s = old.shape[0] // num_ranks
    missing = np.setdiff1d(new, old)
    assert missing.size == 0, f"expert {missing[0]} of the new placement is held nowhere in the old one"
    old_by_rank = old.reshape(num_ranks, s)
    src_rank = np.empty((num_ranks, s), dtype=np.int64)
    src_slot = np.empty((num_ranks, s), dtype=np.int64)
    for r in range(num_ranks):
        for j, e in enumerate(new[r * s : (r + 1) * s].tolist()):
            here = np.flatnonzero(old_by_rank[r] == e)
            if here.size:
                src_rank[r, j], src_slot[r, j] = r, here[0]
                continue
            holders = np.flatnonzero((old_by_rank == e).any(axis=1))
            q = int(holders[(r + j) % holders.size])
            src_rank[r, j], src_slot[r, j] = q, np.flatnonzero(old_by_rank[q] == e)[0]
    return SlotSources(src_rank, src_slot)
