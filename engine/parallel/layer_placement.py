"""One MoE layer's placement in the form dispatch reads: phy2log and the maps derived from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.engine.parallel.eplb import log2phy, logcnt


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    phy2log: np.ndarray  # [P] logical expert of each physical slot
    log2phy: np.ndarray  # [E, max replicas] slots of each expert, ascending, -1 padded
    logcnt: np.ndarray  # [E] replicas of each expert
    rank_of_slot: np.ndarray  # [P] rank holding slot p (p // S)
    local_slot: np.ndarray  # [P] its index there (p % S)
    num_ranks: int

    @classmethod
    def of(cls, phy2log: np.ndarray, num_logical: int, num_ranks: int) -> "LayerPlacement":
        row = np.asarray(phy2log, dtype=np.int64).copy()
        assert row.ndim == 1 and row.shape[0] % num_ranks == 0, (
            f"{row.shape[0]} slots do not split over {num_ranks} ranks")
        counts = logcnt(row[None], num_logical)[0]
        missing = np.flatnonzero(counts == 0)
        assert missing.size == 0, f"expert {missing[0] if missing.size else -1} has no slot"
        s = row.shape[0] // num_ranks
        slots = np.arange(row.shape[0])
        return cls(row, log2phy(row[None], num_logical)[0], counts, slots // s, slots % s, num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[0] // self.num_ranks

    def experts_of(self, rank: int) -> np.ndarray:
        """[S] logical expert of each of ``rank``'s slots."""
        s = self.slots_per_rank
        return self.phy2log[rank * s : (rank + 1) * s]
