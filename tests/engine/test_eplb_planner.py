"""The EPLB planner (engine/parallel/eplb): worked examples, invariants, properties."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.engine.parallel.eplb.packing import STEP_TEMP, refine_soft, step_cost
from deepinfer.engine.parallel.eplb import (
    check_placement,
    gpu_loads,
    gpu_share,
    imbalance,
    log2phy,
    logcnt,
    pack,
    plan,
    replica_counts,
    spread_counts,
    static_placement,
)


def realised(load, phy2log, num_gpus):
    return imbalance(gpu_loads(load, gpu_share(phy2log, load.shape[-1], num_gpus)))


def _judged(data, phy2log, num_logical, num_gpus):
    """What the keep rule compares: the window mean's heaviest GPU, or the smoothed step cost."""
    loads = gpu_loads(data, gpu_share(phy2log, num_logical, num_gpus))  # [1, gpus] or [T, 1, gpus]
    return loads.max() if data.ndim == 2 else step_cost(loads[:, 0], STEP_TEMP)


@pytest.mark.timeout(120)
def test_worked_example_swap_fixes_lpt():
    # 6 experts, 2 GPUs, no spares. LPT: 10 | 9, 8 | 7, 6 | 2 -> GPU0 {10, 7, 6} = 23, GPU1
    # {9, 8, 2} = 19; swapping 10 and 8 makes 21 | 21. GPU slots are sorted by expert.
    load = np.array([[10.0, 9, 8, 7, 6, 2]])
    phy2log = plan(load, 6, 2)
    assert phy2log.tolist() == [[2, 3, 4, 0, 1, 5]]
    assert realised(load, phy2log, 2) == 1.0


@pytest.mark.timeout(120)
def test_worked_example_with_spare_slots():
    # 4 experts [40, 30, 20, 10] on 4 GPUs with one spare slot each (8 slots, 2 per GPU).
    # Counts by the heaviest-replica rule: 40 -> 20, 30 -> 15, 20 (expert 0, lower id) -> 13.3,
    # 20 -> 10: [3, 2, 2, 1]. LPT puts an expert's replicas on different GPUs,
    # {15, 13.3} {15, 10} {13.3, 10} {13.3, 10}; the best swap pairs two replicas of expert 0
    # (26.7) and frees GPU 0 (25). 26.7 / 25 is the best these counts allow. A count move then
    # hands one of those expert-0 slots to expert 3: counts [2, 2, 2, 2], replicas
    # 20 20 15 15 10 10 5 5, and swaps reach {15, 10} {20, 5} {20, 5} {15, 10}: 25 each.
    load = np.array([[40.0, 30, 20, 10]])
    assert replica_counts(load, 8).tolist() == [[3, 2, 2, 1]]
    assert spread_counts(load, 8).tolist() == [[2, 2, 2, 2]]
    uneven = np.array([0, 0, 0, 1, 1, 2, 2, 3])  # slot -> expert
    pack_of = pack((load[0] / [3, 2, 2, 1])[uneven], 4, 2, kind=uneven)
    assert pack_of.tolist() == [2, 3, 2, 0, 1, 0, 3, 1]  # two replicas of expert 0 on GPU 2
    assert np.bincount(pack_of, weights=(load[0] / [3, 2, 2, 1])[uneven]).max() == pytest.approx(80 / 3)
    phy2log = plan(load, 8, 4)
    assert phy2log.tolist() == [[1, 2, 0, 3, 0, 3, 1, 2]]
    assert logcnt(phy2log, 4).tolist() == [[2, 2, 2, 2]]
    assert log2phy(phy2log, 4).tolist() == [[[2, 4], [0, 6], [1, 7], [3, 5]]]
    assert realised(load, phy2log, 4) == 1.0


@pytest.mark.timeout(120)
def test_history_separates_experts_busy_in_the_same_steps():
    # experts 0 and 2 are busy in even steps, 1 and 3 in odd ones: equal means, so mean-only
    # LPT pairs 0 with 2 and every step has one GPU doing all the work
    history = np.array([[[10.0, 0, 10, 0]], [[0, 10, 0, 10]]] * 3)
    load = history.sum(axis=0)
    mean_only = plan(load, 4, 2)
    with_history = plan(load, 4, 2, history=history)
    assert realised(history, mean_only, 2) == 2.0
    assert realised(history, with_history, 2) == 1.0
    assert realised(load, with_history, 2) == 1.0


@pytest.mark.timeout(120)
def test_replica_counts_minimise_the_heaviest_replica():
    assert replica_counts(np.array([[60.0, 20, 10, 10]]), 6).tolist() == [[3, 1, 1, 1]]
    assert replica_counts(np.array([[1.0, 1, 1, 1]]), 6).tolist() == [[2, 2, 1, 1]]  # ties: lower id
    assert replica_counts(np.zeros((2, 3)), 3).tolist() == [[1, 1, 1]] * 2


@pytest.mark.timeout(120)
def test_counts_move_when_replicas_cannot_split_evenly():
    # 273 tokens in three replicas of 91 on 2 GPUs x 3 slots: {91, 91, 2} | {91, 2, 2}, 184 vs 95.
    # One replica moved from expert 1 to expert 0 halves both hot experts: 139.5 each.
    load = np.array([[2.0, 273, 2, 2]])
    assert replica_counts(load, 6).tolist() == [[1, 3, 1, 1]]
    phy2log = plan(load, 6, 2)
    assert logcnt(phy2log, 4).tolist() == [[2, 2, 1, 1]]
    assert phy2log.tolist() == [[0, 1, 3, 0, 1, 2]]  # 1 + 136.5 + 2 on each GPU
    assert realised(load, phy2log, 2) == 1.0


@pytest.mark.timeout(120)
def test_hierarchical_keeps_each_expert_inside_one_node():
    rng = np.random.default_rng(3)
    load = rng.pareto(1.2, (3, 32)) * 100
    num_gpus, num_nodes, num_physical = 8, 2, 48  # 6 slots per GPU, 4 GPUs and 16 experts per node
    phy2log = plan(load, num_physical, num_gpus, num_nodes)
    check_placement(phy2log, 32, num_gpus)
    node_of_slot = np.arange(num_physical) // (num_physical // num_nodes)
    for layer in range(3):
        nodes = [set(node_of_slot[phy2log[layer] == e]) for e in range(32)]
        assert all(len(n) == 1 for n in nodes)
        assert [sum(n == {k} for n in nodes) for k in range(num_nodes)] == [16, 16]


@pytest.mark.timeout(120)
def test_preconditions_are_asserted():
    load = np.ones((1, 8))
    with pytest.raises(AssertionError, match="do not split over 3 GPUs"):
        plan(load, 10, 3)
    with pytest.raises(AssertionError, match="cannot hold"):
        plan(load, 4, 2)
    with pytest.raises(AssertionError, match="do not split over 3 nodes"):
        plan(load, 12, 3, 3)
    with pytest.raises(AssertionError, match="non-negative"):
        plan(-load, 8, 2)
    with pytest.raises(AssertionError, match="no replica"):
        check_placement(np.zeros((1, 8), dtype=np.int64), 2, 2)


@pytest.mark.timeout(120)
def test_pack_fills_every_pack_exactly():
    weight = np.array([5.0, 5, 5, 1, 1, 1, 1, 1, 1])
    pack_of = pack(weight, 3, 3)
    assert np.bincount(pack_of, minlength=3).tolist() == [3, 3, 3]
    assert sorted(np.bincount(pack_of, weights=weight)) == [7, 7, 7]


@st.composite
def problems(draw):
    num_nodes = draw(st.sampled_from([1, 1, 2]))
    num_gpus = num_nodes * draw(st.integers(1, 4))
    experts_per_gpu = draw(st.integers(1, 4))
    num_logical = num_gpus * experts_per_gpu
    redundant = draw(st.integers(0, 3))
    num_layers = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["uniform", "zipf", "sparse", "zeros"]))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        load = rng.uniform(0, 100, (num_layers, num_logical))
    elif kind == "zipf":
        load = rng.zipf(1.3, (num_layers, num_logical)).astype(float)
    elif kind == "sparse":
        load = rng.uniform(0, 100, (num_layers, num_logical)) * (rng.random((num_layers, num_logical)) < 0.3)
    else:
        load = np.zeros((num_layers, num_logical))
    history = None
    if draw(st.booleans()):
        steps = draw(st.integers(1, 6))
        history = rng.dirichlet(np.ones(steps), size=(num_layers, num_logical)).transpose(2, 0, 1) * load[None]
    return load, num_logical + num_gpus * redundant, num_gpus, num_nodes, history


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plan_invariants_and_quality(problem):
    load, num_physical, num_gpus, num_nodes, history = problem
    num_layers, num_logical = load.shape
    phy2log = plan(load, num_physical, num_gpus, num_nodes, history=history)
    assert phy2log.shape == (num_layers, num_physical) and phy2log.dtype == np.int64
    check_placement(phy2log, num_logical, num_gpus)
    counts = logcnt(phy2log, num_logical)
    assert (counts >= 1).all() and (counts.sum(axis=1) == num_physical).all()
    # log2phy inverts phy2log: every slot listed once, under its own expert
    table = log2phy(phy2log, num_logical)
    for layer in range(num_layers):
        listed = table[layer][table[layer] >= 0]
        assert sorted(listed.tolist()) == list(range(num_physical))
        for expert in range(num_logical):
            slots = table[layer, expert][: counts[layer, expert]]
            assert (phy2log[layer, slots] == expert).all()
            assert (table[layer, expert][counts[layer, expert]:] == -1).all()
    # LPT's bound, kept by the swaps: the heaviest GPU is within one replica of the mean; with
    # nodes, the heaviest node within one expert of the mean node
    if history is None:
        gpu = gpu_loads(load, gpu_share(phy2log, num_logical, num_gpus))  # [layers, gpus]
        slack = 1e-9 * (1 + load.sum(axis=1))
        if num_nodes == 1:
            assert (gpu.max(axis=1) <= gpu.mean(axis=1) + (load / counts).max(axis=1) + slack).all()
        node = gpu.reshape(num_layers, num_nodes, -1).sum(axis=2)
        assert (node.max(axis=1) <= node.mean(axis=1) + load.max(axis=1) + slack).all()
    # handed the start-up placement as the one in service, no layer gets worse on the statistics
    # the plan is made from, and a layer that changes gets strictly better
    static = static_placement(num_layers, num_logical, num_physical, num_gpus)
    kept = plan(load, num_physical, num_gpus, num_nodes, history=history, current=static)
    for layer in range(num_layers):
        data = load[layer : layer + 1] if history is None else history[:, layer : layer + 1]
        cost = [_judged(data, p[layer : layer + 1], num_logical, num_gpus) for p in (kept, static)]
        assert (kept[layer] == static[layer]).all() or cost[0] < cost[1]


@pytest.mark.timeout(60)
def test_step_cost_worked_example():
    # one step, packs [10, 10]: max 10, log-sum-exp at tau = 0.1 x 10 = 1 adds log 2
    steps = np.array([[10.0, 10.0]])
    assert step_cost(steps, 0.0) == 10.0
    assert step_cost(steps, 0.1) == pytest.approx(10.0 + np.log(2.0))
    # a pack far below the slowest adds almost nothing; temperature 0 is the plain mean of maxes
    assert step_cost(np.array([[10.0, 0.0], [4.0, 6.0]]), 0.01) == pytest.approx(8.0, abs=1e-3)
    assert step_cost(np.array([[10.0, 0.0], [4.0, 6.0]]), 0.0) == 8.0


@pytest.mark.timeout(60)
def test_smoothed_swaps_reach_the_split_that_balances_every_step():
    # 2 steps, 4 items on 2 packs of 2; per item [[6, 4, 3, 1], [1, 3, 4, 6]]: pairing items 0
    # and 1 leaves a step at 10, 0 and 2 at 9, 0 and 3 balances both steps. One swap from any start.
    history = np.array([[6.0, 4, 3, 1], [1, 3, 4, 6]])
    for start in ([0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 1, 0]):
        pack_of = refine_soft(history, np.array(start), 2, 0.05)
        assert np.bincount(pack_of, minlength=2).tolist() == [2, 2]
        loads = np.zeros((2, 2))
        np.add.at(loads.T, pack_of, history.T)
        # {6, 1} | {4, 3}: 7 | 7 in both steps, the perfect split
        assert loads.tolist() == [[7.0, 7.0], [7.0, 7.0]]


@st.composite
def soft_problems(draw):
    num_packs = draw(st.integers(2, 4))
    per_pack = draw(st.integers(1, 5))
    steps = draw(st.integers(1, 8))
    temp = draw(st.sampled_from([0.01, 0.04, 0.2]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    history = rng.gamma(0.5, 10.0, (steps, num_packs * per_pack))
    start = rng.permutation(np.repeat(np.arange(num_packs), per_pack))
    return history, start, num_packs, per_pack, temp


@pytest.mark.timeout(300)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(soft_problems())
def test_smoothed_refinement_keeps_pack_sizes_and_never_worsens(problem):
    history, start, num_packs, per_pack, temp = problem
    pack_of = refine_soft(history, start, num_packs, temp)
    assert np.bincount(pack_of, minlength=num_packs).tolist() == [per_pack] * num_packs

    def cost(assign):
        loads = np.zeros((history.shape[0], num_packs))
        np.add.at(loads.T, assign, history.T)
        return step_cost(loads, temp)

    assert cost(pack_of) <= cost(start) * (1 + 1e-12)
    # the smoothed cost bounds the exact one: max <= lse <= max + tau log(packs)
    loads = np.zeros((history.shape[0], num_packs))
    np.add.at(loads.T, pack_of, history.T)
    exact = step_cost(loads, 0.0)
    assert exact <= cost(pack_of) + 1e-9
    assert cost(pack_of) <= exact + temp * loads.mean(axis=1).mean() * np.log(num_packs) + 1e-9


@pytest.mark.timeout(120)
def test_prefill_plan_stays_within_seconds():
    # 4 layers x 256 experts, EP4 with 4 spares per GPU, a 100-step window of skewed loads
    import time

    rng = np.random.default_rng(0)
    base = rng.gamma(0.7, 1.0, (4, 256))
    history = rng.poisson(300 * base[None] * rng.lognormal(0, 0.5, (100, 4, 256))).astype(float)
    t0 = time.perf_counter()
    phy2log = plan(history.sum(axis=0), 256 + 16, 4, history=history)
    seconds = time.perf_counter() - t0
    check_placement(phy2log, 256, 4)
    assert seconds < 30  # about 3 s on an idle 2-core VM; the bound leaves room for a busy one
