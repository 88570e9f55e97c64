"""Per-step GPU loads when the replicas of an expert do not split its tokens evenly but the
dispatcher sends them to the less-loaded replica (engine/parallel/eplb/replica_choice.py,
LEAST_LOADED), replayed over a trace's step counts.

The trace holds a step's counts summed over the group's home ranks, so this is one dispatcher
over the whole step: the bound of what the EP layer reaches, where each home rank balances only
its own pairs (their contributions add up; the group's slowest rank is at most the sum of each
home rank's slowest). The EP layer serves this rule on a layer only where it measures better
than the even split.
"""

from __future__ import annotations

import numpy as np

from deepinfer.engine.parallel.eplb import log2phy, logcnt
from deepinfer.engine.parallel.eplb.replica_choice import least_loaded_bounds


def least_loaded_peaks(steps: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """steps: [n, layers, E] token counts; phy2log: [layers, P] -> (sum over layers of the
    slowest GPU [n], sum over layers of the mean GPU [n])."""
    num_steps, num_layers, num_logical = steps.shape
    slots = phy2log.shape[1] // num_gpus
    rank_of_slot = np.arange(phy2log.shape[1]) // slots
    maps = log2phy(phy2log, num_logical)
    counts = logcnt(phy2log, num_logical)
    peak, mean = np.zeros(num_steps), np.zeros(num_steps)
    for layer in range(num_layers):
        table, cnt = maps[layer], counts[layer]
        valid = table >= 0
        slot_rank = np.where(valid, rank_of_slot[np.maximum(table, 0)], 0)
        for t in range(num_steps):
            n = np.rint(steps[t, layer]).astype(np.int64)
            bound = least_loaded_bounds(n, table, cnt, rank_of_slot, num_gpus)
            alloc = np.diff(bound, axis=1, prepend=0) * valid  # [E, C] tokens per replica
            loads = np.bincount(slot_rank.ravel(), weights=alloc.ravel(), minlength=num_gpus)
            peak[t] += loads.max()
            mean[t] += loads.mean()
    return peak, mean
