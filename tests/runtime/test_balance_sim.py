"""The cluster simulator behind `deepinfer bench balance`: workload, engines, accounting."""

from dataclasses import replace

import pytest

from deepinfer.runtime.balance import DecodeStepCost, PrefillCost
from tests.conftest import load_bench_package

load_bench_package()
from deepinfer_bench.sim.cluster import ClusterConfig, Simulation, size_pools  # noqa: E402
from deepinfer_bench.sim.engines import DecodeGroup, PrefillEngine, SimRequest  # noqa: E402
from deepinfer_bench.sim.metrics import percentile, weighted_percentile  # noqa: E402
from deepinfer_bench.sim.workload import WorkloadConfig, generate_trace, ideal_prefill_seconds  # noqa: E402

SMALL = WorkloadConfig(duration_s=90.0, warmup_s=20.0)
SMALL_CLUSTER = ClusterConfig(num_prefill=4, num_decode=4, num_ve=2)


def test_trace_is_deterministic_and_seed_dependent():
    cost = PrefillCost()
    a = generate_trace(SMALL, 4, cost, seed=3, num_calibration_sessions=300)
    b = generate_trace(SMALL, 4, cost, seed=3, num_calibration_sessions=300)
    c = generate_trace(SMALL, 4, cost, seed=4, num_calibration_sessions=300)
    key = lambda t: [(s.start_s, s.prefix_id, [(x.new_tokens, x.output_tokens, x.think_s) for x in s.turns]) for s in t.sessions]
    assert key(a) == key(b)
    assert key(a) != key(c)


def test_turns_extend_the_previous_prompt():
    trace = generate_trace(SMALL, 4, PrefillCost(), seed=1, num_calibration_sessions=300)
    bs = SMALL.block_size
    for s in trace.sessions[:200]:
        prev = s.block_hashes(s.prompt_tokens(0), bs)
        assert s.prompt_tokens(0) <= SMALL.max_context_tokens
        for k in range(1, len(s.turns)):
            cur = s.block_hashes(s.prompt_tokens(k), bs)
            assert cur[: len(prev)] == prev
            prev = cur
    chats = [s for s in trace.sessions if not s.is_agent]
    same_prefix = [s for s in chats if s.prefix_id == chats[0].prefix_id and s.prefix_tokens >= bs]
    if len(same_prefix) >= 2:  # sessions sharing a system prompt share its full blocks
        n = same_prefix[0].prefix_tokens // bs
        assert same_prefix[0].block_hashes(10**5, bs)[:n] == same_prefix[1].block_hashes(10**5, bs)[:n]


def test_session_rate_hits_the_target_prefill_load():
    cfg = replace(SMALL, duration_s=400.0, warmup_s=50.0)
    cost = PrefillCost()
    trace = generate_trace(cfg, 8, cost, seed=0, num_calibration_sessions=2000)
    demand = sum(ideal_prefill_seconds(s, cfg.block_size, cost) for s in trace.sessions)
    # heavy tails make one trace's load noisy; the mean over sessions is what is calibrated
    assert 0.55 < demand / (cfg.duration_s * 8) < 1.1


def test_prefill_engine_lru_keeps_prefixes_and_reports_events():
    bs = 4
    engine = PrefillEngine(0, PrefillCost(), capacity_blocks=5, block_size=bs)

    def req(rid, hashes):
        return SimRequest(rid, None, 0, 0.0, len(hashes) * bs + 1, hashes, 2, ())

    first = req(1, [1, 2, 3])
    engine.enqueue(first)
    engine.start_next(0.0)
    _, stored, evicted = engine.finish()
    assert stored == [3, 2, 1] and evicted == []
    second = req(2, [1, 2, 3, 4, 5, 6])
    engine.enqueue(second)
    engine.start_next(1.0)
    assert second.num_cached_tokens == 3 * bs
    _, stored, evicted = engine.finish()
    assert stored == [6, 5, 4] and evicted == [6]  # the newest leaf goes, never a parent
    third = req(3, [1, 2, 3, 4, 5, 6])
    assert engine.num_hit_tokens(third) == 5 * bs


def test_decode_group_accounts_every_token_and_returns_all_kv():
    group = DecodeGroup(2, DecodeStepCost(), max_requests=1, kv_capacity_tokens=10**9)
    reqs = [SimRequest(i, None, 0, 0.0, 100 * (i + 1), [], out, ()) for i, out in enumerate([3, 5, 2])]
    for r, rank in zip(reqs, [0, 0, 1]):
        r.first_token_s = 0.0
        group.assign(rank, r)
        group.arrive(rank, r)
    now, done = 0.0, []
    while True:
        end = group.begin_step(now)
        if end is None:
            break
        done += group.end_step(end)
        now = end
    assert sorted(r.request_id for r in done) == [0, 1, 2]
    assert sum(s.num_running for s in group.steps) == sum(out - 1 for out in (3, 5, 2))
    assert group.rank2kv == [0, 0] and group.rank2running == [0, 0]
    assert all(s.balanced_seconds <= s.seconds + 1e-12 for s in group.steps)
    assert len(group.first_gaps) == 3


def test_percentiles():
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([], 99) == 0.0
    assert weighted_percentile([(1.0, 9), (10.0, 1)], 50) == 1.0
    assert weighted_percentile([(1.0, 9), (10.0, 1)], 95) == 10.0


@pytest.mark.timeout(120)
def test_small_cluster_run_is_deterministic_and_complete():
    trace = generate_trace(SMALL, SMALL_CLUSTER.num_prefill, SMALL_CLUSTER.prefill_cost, seed=2, num_calibration_sessions=300)
    sizing = size_pools(trace, SMALL_CLUSTER)
    sim = Simulation(trace, SMALL_CLUSTER, "ours", sizing)
    result = sim.run()
    assert all(r.finish_s >= r.first_token_s >= r.arrival_s for r in sim.requests)
    assert sim.decode.rank2kv == [0] * 4 and sum(sim.decode.rank2incoming) == 0
    assert 0.5 < result.decode_balance_efficiency <= 1.0
    assert 0.0 < result.hit_rate < 1.0 and result.num_requests > 100
    sim.policy.index.check_integrity()
    again = Simulation(trace, SMALL_CLUSTER, "ours", sizing).run()
    assert (again.ttft_p99_s, again.hit_rate, again.decode_balance_efficiency) == (
        result.ttft_p99_s, result.hit_rate, result.decode_balance_efficiency)
