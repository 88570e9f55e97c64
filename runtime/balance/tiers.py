"""Context-length tiers for prefill: which tier a request falls in, how many engines each tier gets.

A tier's engine count follows its share of prefill *compute* in the previous round (seconds from
the quadratic cost model, not token counts: one 512K-token prompt costs as much as ~300 prompts
of 2K tokens). Counts come from greedy minimax apportionment, the same step deepseek-ai/EPLB uses
to replicate hot experts: every tier with demand gets one engine, then each further engine goes
to the tier whose demand per engine is currently highest. That minimises the largest per-engine
demand, which is what bounds a tier's queueing.

Re-assignment is stable: an engine keeps its tier when the counts allow it, so its prefix cache
keeps serving the sessions that filled it; only surplus engines move, the least busy first.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence

# Upper bounds (exclusive) of every tier but the last: <16K, 16-64K, 64-256K, >=256K tokens.
DEFAULT_TIER_BOUNDS = (16 * 1024, 64 * 1024, 256 * 1024)


def check_tier_bounds(bounds: Sequence[int]) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in bounds)
    if any(b <= 0 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"tier bounds must be positive and strictly increasing, got {bounds}")
    return bounds


def tier_of(num_tokens: int, bounds: Sequence[int]) -> int:
    return bisect_right(bounds, num_tokens)


def apportion(tier2demand: Sequence[float], num_engines: int) -> list[int]:
    """Engines per tier in proportion to demand (greedy minimax); tiers without demand get none.

    With fewer engines than demanding tiers, the most demanding tiers get one each.
    """
    num_tiers = len(tier2demand)
    counts = [0] * num_tiers
    demanding = sorted((t for t in range(num_tiers) if tier2demand[t] > 0), key=lambda t: -tier2demand[t])
    if not demanding or num_engines <= 0:
        return counts
    for t in demanding[:num_engines]:
        counts[t] = 1
    for _ in range(num_engines - min(num_engines, len(demanding))):
        # ties go to the longer tier: its jobs are the ones that block a queue longest
        best = max(demanding, key=lambda t: (tier2demand[t] / counts[t], t))
        counts[best] += 1
    return counts


def reassign(
    engine2tier: Mapping[int, int],
    tier2count: Sequence[int],
    engine2backlog: Mapping[int, float],
) -> dict[int, int]:
    """Move as few engines as possible so that tier t holds ``tier2count[t]`` engines.

    ``engine2tier`` is the current assignment (engines missing from it are new and unassigned);
    the result covers exactly the engines of ``engine2backlog``. Surplus engines leave their tier
    least-busy first (a busy engine's queue was routed for its old tier) and join the tier nearest
    to their old one (neighbouring tiers share the sessions that grow across a bound).
    """
    if sum(tier2count) != len(engine2backlog):
        raise ValueError(f"tier counts {list(tier2count)} do not add up to {len(engine2backlog)} engines")
    tier2members: list[list[int]] = [[] for _ in tier2count]
    free: list[int] = []
    for e in sorted(engine2backlog):
        t = engine2tier.get(e, -1)
        (tier2members[t] if 0 <= t < len(tier2count) else free).append(e)
    for t, members in enumerate(tier2members):
        surplus = len(members) - tier2count[t]
        if surplus > 0:
            members.sort(key=lambda e: (engine2backlog[e], e))
            free.extend(members[:surplus])
            del members[:surplus]
    result = {e: t for t, members in enumerate(tier2members) for e in members}
    for t in range(len(tier2count)):
        for _ in range(tier2count[t] - len(tier2members[t])):
            old = engine2tier.get
            e = min(free, key=lambda e: (abs(old(e, t) - t), engine2backlog[e], e))
            free.remove(e)
            result[e] = t
    return result
