import pytest

from deepinfer.runtime.balance import DEFAULT_TIER_BOUNDS, PrefillLoad, TierPlanner, apportion, reassign, tier_of


def test_tier_bounds_are_exclusive_upper_bounds():
    assert DEFAULT_TIER_BOUNDS == (16384, 65536, 262144)
    assert [tier_of(n, DEFAULT_TIER_BOUNDS) for n in (1, 16383, 16384, 65535, 65536, 262143, 262144, 10**6)] == [
        0, 0, 1, 1, 2, 2, 3, 3,
    ]


def test_apportion_follows_demand_shares():
    assert apportion([1.0, 2.0, 4.0, 1.0], 16) == [2, 4, 8, 2]
    assert sum(apportion([3.0, 1.0, 0.5, 7.0], 16)) == 16


def test_apportion_minimises_the_largest_demand_per_engine():
    demand = [5.0, 1.0, 9.0, 2.5]
    counts = apportion(demand, 11)
    worst = max(d / c for d, c in zip(demand, counts))
    # no single move of one engine between tiers lowers the worst per-engine demand
    for src in range(4):
        for dst in range(4):
            if src == dst or counts[src] <= 1:
                continue
            moved = list(counts)
            moved[src] -= 1
            moved[dst] += 1
            assert max(d / c for d, c in zip(demand, moved)) >= worst - 1e-12


def test_apportion_skips_idle_tiers_and_handles_few_engines():
    assert apportion([0.0, 3.0, 0.0, 1.0], 4) == [0, 3, 0, 1]
    assert apportion([1.0, 5.0, 2.0, 0.0], 2) == [0, 1, 1, 0]
    assert apportion([0.0, 0.0], 4) == [0, 0]


def test_reassign_moves_as_few_engines_as_possible():
    current = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
    backlog = {e: 0.0 for e in current}
    backlog[1] = 9.0  # busy: should not be the one that leaves tier 0
    plan = reassign(current, [2, 2, 2], backlog)
    assert sorted(plan) == sorted(current)
    assert [sum(1 for t in plan.values() if t == k) for k in range(3)] == [2, 2, 2]
    moved = [e for e in plan if plan[e] != current[e]]
    assert len(moved) == 1 and moved[0] in (0, 2) and plan[moved[0]] == 2
    assert plan[1] == 0


def test_reassign_rejects_counts_that_do_not_add_up():
    with pytest.raises(ValueError, match="do not add up"):
        reassign({0: 0}, [1, 1], {0: 0.0})


def _loads(n):
    return [PrefillLoad(e, 0, 0.0) for e in range(n)]


def test_planner_assigns_engines_by_compute_share_of_the_last_round():
    planner = TierPlanner(round_s=10.0)
    loads = _loads(8)
    planner.maybe_end_round(0.0, loads)
    assert planner.engine2tier == {}  # first round: every engine serves every tier
    # in-round busy seconds: tier 0 = 10 s, tier 2 = 30 s (one long job counts only inside the round)
    for e in range(5):
        planner.record(e, 0, 1.0, 3.0)
    planner.record(6, 2, 2.0, 8.0)
    planner.record(7, 2, 0.0, 24.0)  # runs 14 s past the round's end
    assert planner.maybe_end_round(10.0, loads)
    assert planner.tier2demand_s == [10.0, 0.0, 16.0, 0.0]
    counts = [sum(1 for t in planner.engine2tier.values() if t == k) for k in range(4)]
    assert counts == [3, 0, 5, 0]
    assert planner.engine2tier[7] == 2  # still busy with tier-2 work
    assert planner.utilization == pytest.approx(26.0 / 80.0)


def test_planner_rejects_bad_round():
    with pytest.raises(ValueError, match="round_s"):
        TierPlanner(round_s=0)
    with pytest.raises(ValueError, match="increasing"):
        TierPlanner(tier_bounds=(100, 50))
