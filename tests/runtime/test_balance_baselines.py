from deepinfer.runtime.balance import (
    AffinityOnly,
    ApproxCacheAware,
    CacheAwareConfig,
    DecodeLoad,
    LeastRequests,
    PrefillLoad,
    PrefixIndex,
    RequestInfo,
    RoundRobin,
)

BS = 16


def request(num_tokens, owner=0):
    return RequestInfo(owner, num_tokens, [owner * 1000 + i for i in range(num_tokens // BS)], BS)


def loads(*counts):
    return [PrefillLoad(e, c, float(c)) for e, c in enumerate(counts)]


def test_round_robin_cycles():
    rr = RoundRobin()
    assert [rr.route(request(32), loads(5, 0, 9), 0.0).engine_id for _ in range(4)] == [0, 1, 2, 0]
    assert RoundRobin().place(request(32), [DecodeLoad(3, 0, 0), DecodeLoad(4, 0, 0)]).engine_id == 3


def test_least_requests_picks_the_fewest_and_rotates_ties():
    lr = LeastRequests()
    assert lr.route(request(32), loads(3, 1, 2), 0.0).engine_id == 1
    picks = {lr.route(request(32), loads(1, 0, 0, 1), 0.0).engine_id for _ in range(4)}
    assert picks == {1, 2}


def test_affinity_only_ignores_load():
    index = PrefixIndex()
    req = request(160, owner=1)
    index.on_stored(2, req.block_hashes)
    choice = AffinityOnly(index).route(req, loads(0, 0, 50), 0.0)
    assert choice.engine_id == 2 and choice.num_cached_tokens == 159 and choice.is_affinity
    assert AffinityOnly(index).route(request(160, owner=9), loads(3, 1, 2), 0.0).engine_id == 1


def test_cache_aware_follows_its_own_routing_history():
    router = ApproxCacheAware()
    first = router.route(request(160, owner=1), loads(0, 0, 0), 0.0)
    again = router.route(request(160, owner=1), loads(0, 0, 0), 0.0)
    assert again.engine_id == first.engine_id and again.is_affinity


def test_cache_aware_sends_weak_matches_to_the_smallest_tree():
    router = ApproxCacheAware()
    router.route(request(320, owner=1), loads(0, 0, 0), 0.0)  # tree of engine 0 grows
    router.route(request(320, owner=2), loads(0, 0, 0), 0.0)  # smallest tree: engine 1
    choice = router.route(request(320, owner=3), loads(0, 0, 0), 0.0)
    assert choice.engine_id == 2 and not choice.is_affinity


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    router = ApproxCacheAware(CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    req = request(160, owner=1)
    assert router.route(req, loads(0, 0, 0), 0.0).engine_id == 0
    assert router.route(req, loads(3, 0, 0), 0.0).engine_id == 0  # 3 - 0 is within the threshold
    assert router.route(req, loads(10, 0, 1), 0.0).engine_id == 1  # imbalanced: shortest queue


def test_cache_aware_trims_its_tree_lru():
    router = ApproxCacheAware(CacheAwareConfig(max_tree_blocks=12))
    router.route(request(160, owner=1), loads(0), 0.0)  # 10 blocks
    router.route(request(160, owner=2), loads(0), 0.0)  # 10 more: 8 oldest leaves go
    assert router.trees.num_blocks(0) == 12
    router.trees.check_integrity()
    kept = router.trees.match(request(160, owner=1).block_hashes)
    assert kept == {0: 2}  # owner 1 keeps its root blocks: leaves were trimmed first
