"""Which replica of an expert each routed (token, expert) pair goes to: pure policy over one
home rank's pairs of one layer.

Two rules, both deterministic in the pairs and the placement:

EVEN          the i-th pair of expert e in the batch (pair order) goes to replica
              ``(i + home_rank) mod logcnt[e]``: every replica takes its share, the model the
              planner places by. The home rank offsets the start so that ranks holding one
              token each do not all pick replica 0.
LEAST_LOADED  the pairs of experts with one replica, or with all replicas on one rank, are
              counted first (they have nowhere else to go); then each replicated expert, the
              one with the most pairs first, fills
              its replicas' ranks up to a common level: its tokens go to the less-loaded
              replica until it has caught up with the next one. This is what sending each
              token to the currently less-loaded replica converges to, computed per expert
              rather than per token. Its first a_0 pairs (pair order) go to replica 0, the next
              a_1 to replica 1, ...

A home rank balances only its own pairs, but the ranks' loads add up: the group's slowest rank
is at most the sum of each home rank's slowest, so balanced contributions give a balanced group.
With few tokens per home rank (decode) the local counts are noise and the even split does as
well; which rule serves a layer is decided by measurement (``RuleChooser``): both rules' loads
are counted on sampled steps and the one whose slowest rank summed over those steps is lower
serves the next stretch (EVEN on ties, and until the first measurement).

Shapes: a layer's placement is given by ``log2phy [E, max replicas]`` (padded with -1),
``logcnt [E]`` and ``rank_of_slot [num_physical]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EVEN, LEAST_LOADED = 0, 1
RULE_NAMES = ("even", "least_loaded")


@dataclass(slots=True)
class PairCounts:
    """Pairs of one batch grouped by expert."""

    expert: np.ndarray  # [P] logical expert of each pair (pair p = token * k + slot)
    per_expert: np.ndarray  # [E] pairs of each expert
    rank_in_expert: np.ndarray  # [P] earlier pairs of the same expert


def count_pairs(expert_of_pair: np.ndarray, num_experts: int) -> PairCounts:
    expert = np.asarray(expert_of_pair, dtype=np.int64).reshape(-1)
    per_expert = np.bincount(expert, minlength=num_experts)
    order = np.argsort(expert, kind="stable")
    first = np.cumsum(per_expert) - per_expert
    rank = np.empty_like(expert)
    rank[order] = np.arange(expert.shape[0]) - first[expert[order]]
    return PairCounts(expert, per_expert, rank)


def even_replicas(pairs: PairCounts, logcnt: np.ndarray, home_rank: int) -> np.ndarray:
    """[P] replica index (0 .. logcnt[e] - 1) of each pair under EVEN."""
    return (pairs.rank_in_expert + home_rank) % logcnt[pairs.expert]


def least_loaded_replicas(pairs: PairCounts, log2phy: np.ndarray, logcnt: np.ndarray, rank_of_slot: np.ndarray,
                          num_ranks: int) -> np.ndarray:
    """[P] replica index of each pair under LEAST_LOADED."""
    bound = least_loaded_bounds(pairs.per_expert, log2phy, logcnt, rank_of_slot, num_ranks)
    # a pair of rank q among its expert's pairs goes to the first replica whose bound exceeds q
    return (pairs.rank_in_expert[:, None] >= bound[pairs.expert]).sum(axis=1)


def least_loaded_bounds(per_expert: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray, rank_of_slot: np.ndarray,
                        num_ranks: int) -> np.ndarray:
    """LEAST_LOADED over token counts: [E, C] pairs given to replicas 0..c of each expert,
    cumulative (replica c of expert e takes ``bound[e, c] - bound[e, c - 1]``)."""
    n = np.asarray(per_expert, dtype=np.int64)
    single = logcnt == 1
    loads = np.bincount(rank_of_slot[log2phy[single, 0]], weights=n[single], minlength=num_ranks).tolist()
    multi = np.flatnonzero(~single & (n > 0))
    # experts whose replicas all sit on one rank have no choice either: they go first
    ranks = np.where(log2phy >= 0, rank_of_slot[np.maximum(log2phy, 0)], -1)  # [E, C]
    flexible = ((ranks != ranks[:, :1]) & (ranks >= 0)).any(axis=1)
    # [E, C] cumulative (an expert's columns past its last replica: all of its pairs)
    bound = np.repeat(n[:, None], log2phy.shape[1], axis=1)
    for e in multi[np.lexsort((-n[multi], flexible[multi]))].tolist():
        c = int(logcnt[e])
        alloc = _level(loads, ranks[e, :c].tolist(), int(n[e]))
        bound[e, :c] = np.cumsum(alloc)
    return bound


def _level(loads: list[float], ranks: list[int], units: int) -> list[int]:
    """Spread ``units`` pairs over replicas on ``ranks`` (a rank may hold two) so their ranks'
    loads rise to a common level; adds them to ``loads``. Returns pairs per replica."""
    distinct = sorted(set(ranks), key=lambda r: (loads[r], r))
    held = [loads[r] for r in distinct]
    # water level: the lowest m ranks rise to (units + their loads) / m, below the (m+1)-th
    m, total = 1, held[0]
    while m < len(distinct) and (units + total) / m > held[m]:
        total += held[m]
        m += 1
    level = (units + total) / m
    give = [max(0, int(level - held[i])) if i < m else 0 for i in range(len(distinct))]
    lightest = sorted(range(m), key=lambda i: (held[i] + give[i], i))
    for i in lightest[: units - sum(give)]:  # the remainder (< m after flooring), lightest first
        give[i] += 1
    per_rank = dict(zip(distinct, give))
    for r, g in per_rank.items():
        loads[r] += g
    # a rank's share split evenly over its replicas there, in replica order
    out, seen = [], {}
    copies = {r: ranks.count(r) for r in distinct}
    for r in ranks:
        j = seen.get(r, 0)
        seen[r] = j + 1
        out.append(per_rank[r] // copies[r] + (1 if j < per_rank[r] % copies[r] else 0))
    return out


def rank_loads(pairs: PairCounts, replica: np.ndarray, log2phy: np.ndarray, rank_of_slot: np.ndarray,
               num_ranks: int) -> np.ndarray:
    """[num_ranks] pairs each rank computes when pair p goes to replica ``replica[p]``."""
    return np.bincount(rank_of_slot[log2phy[pairs.expert, replica]], minlength=num_ranks)


class RuleChooser:
    """Per layer, which rule serves: measured on sampled steps, decided every ``period`` steps.

    ``record(layer, peak_even, peak_least)`` takes one sampled step's slowest-rank load under
    each rule (the group's, not one home rank's); ``decide()`` picks per layer the rule with the
    lower sum, EVEN unless LEAST_LOADED is lower by more than ``margin`` (relative), and clears
    the sums.
    """

    def __init__(self, num_layers: int, margin: float = 1e-3):
        self.margin = margin
        self.rule = np.full(num_layers, EVEN, dtype=np.int64)
        self._peaks = np.zeros((num_layers, 2))

    def record(self, peaks: np.ndarray) -> None:
        """peaks: [layers, 2] slowest rank per layer under (EVEN, LEAST_LOADED) for one step."""
        self._peaks += np.asarray(peaks, dtype=np.float64)

    def decide(self) -> np.ndarray:
        even, least = self._peaks[:, EVEN], self._peaks[:, LEAST_LOADED]
        measured = even > 0
        self.rule = np.where(measured & (least < even * (1 - self.margin)), LEAST_LOADED, EVEN)
        self._peaks[:] = 0.0
        return self.rule
