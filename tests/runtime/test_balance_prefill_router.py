import pytest

from deepinfer.runtime.balance import (
    PrefillCost,
    PrefillLoad,
    PrefillRouterConfig,
    PrefixIndex,
    RequestInfo,
    TieredPrefillRouter,
    TierPlanner,
)

BS = 512
COST = PrefillCost()


def request(num_tokens, owner=0, rid=0):
    return RequestInfo(rid, num_tokens, [owner * 10**6 + i for i in range(num_tokens // BS)], BS)


def loads(*backlogs):
    return [PrefillLoad(e, int(b > 0), b) for e, b in enumerate(backlogs)]


def make_router(**config):
    index = PrefixIndex()
    planner = TierPlanner(round_s=10.0)
    return index, TieredPrefillRouter(index, COST, PrefillRouterConfig(**config), planner)


def test_affinity_wins_when_load_is_equal():
    index, router = make_router()
    req = request(40_000, owner=1)
    index.on_stored(2, req.block_hashes)
    choice = router.route(req, loads(1.0, 1.0, 1.0, 1.0), now=0.0)
    assert choice.engine_id == 2
    assert choice.num_cached_tokens == len(req.block_hashes) * BS
    assert choice.predicted_s == pytest.approx(COST.seconds(40_000 - choice.num_cached_tokens, choice.num_cached_tokens))


def test_affinity_outweighs_a_moderate_load_difference():
    index, router = make_router()
    req = request(40_000, owner=1)
    index.on_stored(2, req.block_hashes)
    # recomputing 40K tokens costs ~2.6 s; waiting 1.5 s more for the cache is the better deal
    assert router.route(req, loads(0.0, 0.0, 1.5, 0.0), now=0.0).engine_id == 2


def test_affinity_loses_past_the_imbalance_bound():
    # a huge compute charge makes the score always prefer the cache; only the bound can say no
    index, router = make_router(compute_weight=1000.0, is_adaptive_weight=False, imbalance_abs_s=1.0, imbalance_rel=0.5)
    req = request(40_000, owner=1)
    index.on_stored(2, req.block_hashes)
    bound = 1.0 + 0.5 * COST.seconds(40_000, 0)
    inside = router.route(req, loads(0.0, 0.0, bound - 0.01, 0.0), now=0.0)
    assert inside.engine_id == 2 and inside.is_affinity
    outside = router.route(req, loads(0.0, 0.0, bound + 0.01, 0.0), now=0.0)
    assert outside.engine_id != 2 and outside.num_cached_tokens == 0


def test_longest_prefix_wins_among_equally_loaded_engines():
    index, router = make_router()
    req = request(20_000, owner=1)
    index.on_stored(0, req.block_hashes[:10])
    index.on_stored(3, req.block_hashes[:30])
    assert router.route(req, loads(0.5, 0.5, 0.5, 0.5), now=0.0).engine_id == 3


def test_without_any_cache_the_least_loaded_engine_wins():
    _, router = make_router()
    assert router.route(request(8000), loads(2.0, 0.3, 0.9, 4.0), now=0.0).engine_id == 1


def _run_round(router, work, round_s=10.0):
    """Route (num_tokens, count) pairs at t=0 on idle engines, then end the round."""
    rid = 0
    for num_tokens, count in work:
        for _ in range(count):
            rid += 1
            router.route(request(num_tokens, owner=rid, rid=rid), loads(*[0.0] * 8), now=0.0)
    router.route(request(1000, owner=999), loads(*[0.0] * 8), now=round_s)


def test_tier_assignment_follows_compute_shares_not_token_counts():
    index = PrefixIndex()
    router = TieredPrefillRouter(index, COST, PrefillRouterConfig(), TierPlanner(round_s=200.0))
    # equal tokens per tier (400 x 2K vs 1 x 800K) but the quadratic term makes the long prompt
    # ~2.6x the compute: a token-count plan would split the engines 4/4
    _run_round(router, [(2000, 400), (800_000, 1)], round_s=200.0)
    planner = router.planner
    short_s = 400 * COST.seconds(2000, 0)
    long_s = COST.seconds(800_000, 0)
    assert planner.tier2demand_s == pytest.approx([short_s, 0.0, 0.0, long_s], rel=1e-9)
    counts = [sum(1 for t in planner.engine2tier.values() if t == k) for k in range(4)]
    assert counts == [2, 0, 0, 6]


def test_busy_time_counts_inside_the_round_only():
    _, router = make_router()
    _run_round(router, [(200_000, 1)])  # ~17 s of work, 10 s of which fall in the round
    assert router.planner.tier2demand_s[2] == pytest.approx(10.0)


def test_long_work_is_confined_to_long_tier_engines_while_short_work_spills():
    _, router = make_router()
    _run_round(router, [(1000, 50), (100_000, 4)])
    e2t = router.planner.engine2tier
    short_engines = [e for e, t in e2t.items() if t == 0]
    long_engines = [e for e, t in e2t.items() if t == 2]
    assert short_engines and long_engines
    # long-tier engines are all busy, short-tier ones idle: a cold long request still waits
    busy = [5.0 if e in long_engines else 0.0 for e in range(8)]
    choice = router.route(request(100_000, owner=77), loads(*busy), now=10.5)
    assert choice.engine_id in long_engines and choice.tier == 2
    # a short request may use an idle long-tier engine
    idle_long = [0.0 if e in long_engines else 5.0 for e in range(8)]
    choice = router.route(request(2000, owner=78), loads(*idle_long), now=10.6)
    assert choice.engine_id in long_engines and choice.tier == 0


def test_cached_long_context_may_descend_to_a_shorter_tier():
    index, router = make_router()
    _run_round(router, [(1000, 50), (100_000, 4)])
    e2t = router.planner.engine2tier
    short_engine = min(e for e, t in e2t.items() if t == 0)
    req = request(100_000, owner=55)
    index.on_stored(short_engine, req.block_hashes[:-2])  # an agent turn: all but ~1K tokens cached
    choice = router.route(req, loads(*[0.0] * 8), now=10.5)
    assert choice.engine_id == short_engine and choice.tier == 2
    cold = request(100_000, owner=56)
    index.on_stored(short_engine, cold.block_hashes[:20])  # only 10K cached: too much work left
    assert e2t[router.route(cold, loads(*[0.0] * 8), now=10.6).engine_id] == 2


def test_compute_charge_grows_with_utilisation():
    _, router = make_router()
    router.planner.utilization = 0.5
    low = router.compute_weight()
    router.planner.utilization = 0.9
    assert router.compute_weight() == pytest.approx(9.0) and low == pytest.approx(1.0)


def test_bad_inputs_are_rejected():
    _, router = make_router()
    with pytest.raises(ValueError, match="load list is empty"):
        router.route(request(1000), [], now=0.0)
    with pytest.raises(ValueError, match="descent_fraction"):
        PrefillRouterConfig(descent_fraction=2.0)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        RequestInfo(1, 0)
    with pytest.raises(ValueError, match="do not fit"):
        RequestInfo(1, 100, [1, 2], 64)
