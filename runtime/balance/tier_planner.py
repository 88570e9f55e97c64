"""Rounds of the prefill tier plan: measure each tier's compute, re-assign engines to tiers.

One planner serves a whole cluster: every gateway's router records the prefills it routes here
and reads the same ``engine2tier``. (Gateways with private plans would disagree about which
engines serve which tier and undo each other's isolation; in a multi-gateway deployment one
gateway runs the planner and publishes the plan, or each derives it from the same engine
reports.)

Compute is counted as predicted engine-busy seconds *inside* the round: a 200-second prefill
occupies one engine for the whole round, not 200/round_s engines, because no prompt is split
across engines. At the end of each round (the first ``record`` or ``maybe_end_round`` whose
``now`` is ``round_s`` past its start) the planner

1. apportions engines to tiers by that compute (``tiers.apportion``),
2. keeps engines still busy with one tier's work in that tier and moves as few others as
   possible (``tiers.reassign``),
3. measures utilisation rho = compute / (engines x round) for the router's compute charge.

Until the first round ends ``engine2tier`` is empty: every engine serves every tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.runtime.balance.tiers import DEFAULT_TIER_BOUNDS, apportion, check_tier_bounds, reassign, tier_of
from deepinfer.runtime.balance.types import PrefillLoad


@dataclass(slots=True)
class _Job:
    """A routed prefill as the round accounting sees it: predicted busy interval on one engine."""

    engine_id: int
    tier: int
    start: float
    end: float


class TierPlanner:
    def __init__(self, tier_bounds: Sequence[int] = DEFAULT_TIER_BOUNDS, round_s: float = 30.0):
        if round_s <= 0:
            raise ValueError(f"round_s must be > 0, got {round_s}")
        self.tier_bounds = check_tier_bounds(tier_bounds)
        self.round_s = round_s
        self.num_tiers = len(self.tier_bounds) + 1
        self.engine2tier: dict[int, int] = {}
        self.tier2demand_s = [0.0] * self.num_tiers  # compute of the last finished round
        self.utilization = 0.0  # of the last finished round
        self._jobs: list[_Job] = []
        self._round_start: float | None = None

    def tier_of(self, num_tokens: int) -> int:
        return tier_of(num_tokens, self.tier_bounds)

    def record(self, engine_id: int, tier: int, start: float, end: float) -> None:
        """A prefill routed to ``engine_id``, predicted to run over ``[start, end)``."""
        self._jobs.append(_Job(engine_id, tier, start, end))

    def maybe_end_round(self, now: float, loads: Sequence[PrefillLoad]) -> bool:
        if self._round_start is None:
            self._round_start = now
            return False
        if now - self._round_start < self.round_s:
            return False
        start = self._round_start
        tier2demand = [0.0] * self.num_tiers
        engine2tier2left: dict[int, list[float]] = {}
        kept: list[_Job] = []
        for job in self._jobs:
            tier2demand[job.tier] += max(0.0, min(job.end, now) - max(job.start, start))
            if job.end > now:
                kept.append(job)
                left = engine2tier2left.setdefault(job.engine_id, [0.0] * self.num_tiers)
                left[job.tier] += job.end - max(job.start, now)
        self._jobs = kept
        self._round_start = now
        self.tier2demand_s = tier2demand
        self.utilization = sum(tier2demand) / ((now - start) * len(loads))
        if sum(tier2demand) <= 0:
            return True
        counts = apportion(tier2demand, len(loads))
        # an engine still busy with one tier's work stays that tier's (its queue cannot switch);
        # idle engines keep their current tier
        home = dict(self.engine2tier)
        for e, left in engine2tier2left.items():
            home[e] = max(range(self.num_tiers), key=lambda t: (left[t], -t))
        backlog = {load.engine_id: load.backlog_s for load in loads}
        self.engine2tier = reassign(home, counts, backlog)
        return True
