"""The pure parts of expert parallelism: replica choice, slot sources of a re-placement, the
dispatch/combine wire layout (exchanges simulated in one process), and EP = 1 in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.parallel.dispatch import pack_rows, plan_dispatch, unpack_rows
from deepinfer.engine.parallel.eplb.replica_choice import (
    EVEN,
    LEAST_LOADED,
    RuleChooser,
    count_pairs,
    even_replicas,
    least_loaded_replicas,
    rank_loads,
)
from deepinfer.engine.parallel.eplb.transfers import slot_sources
from deepinfer.engine.parallel.layer_placement import LayerPlacement
from tests.conftest import load_test_helper

harness = load_test_helper("engine/parallel/ep_harness")


def test_even_split_gives_every_replica_its_share():
    # expert 0 has replicas in slots 0 and 3 (ranks 0 and 1), expert 1 one replica
    place = LayerPlacement.of(np.array([0, 1, 2, 0, 3, 2]), 4, 2)
    pairs = count_pairs(np.array([0, 0, 0, 0, 0, 1, 2, 2, 2]), 4)
    assert pairs.per_expert.tolist() == [5, 1, 3, 0]
    assert pairs.rank_in_expert.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2]
    for home in (0, 1):
        replica = even_replicas(pairs, place.logcnt, home)
        assert np.bincount(replica[:5]).tolist() in ([3, 2], [2, 3])
        assert (replica[5] == 0) and np.bincount(replica[6:]).tolist() in ([2, 1], [1, 2])
    # home ranks start at different replicas: one token each does not pile onto replica 0
    one = count_pairs(np.array([0]), 4)
    assert {int(even_replicas(one, place.logcnt, h)[0]) for h in (0, 1)} == {0, 1}


def test_least_loaded_fills_the_lighter_rank_first():
    # 2 ranks x 3 slots: rank 0 holds experts 0, 1, 2; rank 1 holds 2, 3, 3. Expert 0 is busy on
    # rank 0 (fixed: one replica), so the replicated expert 2 goes to rank 1 until both are level
    place = LayerPlacement.of(np.array([0, 1, 2, 2, 3, 3]), 4, 2)
    experts = np.array([0] * 6 + [2] * 6 + [3] * 2)
    pairs = count_pairs(experts, 4)
    least = least_loaded_replicas(pairs, place.log2phy, place.logcnt, place.rank_of_slot, 2)
    loads = rank_loads(pairs, least, place.log2phy, place.rank_of_slot, 2)
    assert loads.tolist() == [7, 7]  # rank 0: 6 + 1 of expert 2; rank 1: 2 + 5 of expert 2
    even = rank_loads(pairs, even_replicas(pairs, place.logcnt, 0), place.log2phy, place.rank_of_slot, 2)
    assert even.tolist() == [9, 5]
    # expert 2's first pair goes to rank 0 (replica 0), the rest to rank 1: pairs keep their order
    assert least[6:12].tolist() == [0, 1, 1, 1, 1, 1]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(0, 2), st.integers(0, 10_000), st.integers(1, 60))
def test_replica_rules_route_every_pair_to_a_slot_of_its_expert(num_ranks, spare, seed, num_pairs):
    rng = np.random.default_rng(seed)
    num_experts = 2 * num_ranks
    phy2log = np.concatenate([rng.permutation(num_experts), rng.integers(0, num_experts, num_ranks * spare)])
    place = LayerPlacement.of(phy2log, num_experts, num_ranks)
    experts = rng.integers(0, num_experts, num_pairs)
    pairs = count_pairs(experts, num_experts)
    for replica in (even_replicas(pairs, place.logcnt, 1),
                    least_loaded_replicas(pairs, place.log2phy, place.logcnt, place.rank_of_slot, num_ranks)):
        assert (replica >= 0).all() and (replica < place.logcnt[experts]).all()
        assert (place.phy2log[place.log2phy[experts, replica]] == experts).all()
        assert rank_loads(pairs, replica, place.log2phy, place.rank_of_slot, num_ranks).sum() == num_pairs


def test_rule_chooser_takes_least_loaded_only_when_it_measures_better():
    chooser = RuleChooser(num_layers=3)
    assert chooser.rule.tolist() == [EVEN] * 3  # until measured
    chooser.record(np.array([[10.0, 8.0], [10.0, 10.0], [10.0, 12.0]]))
    chooser.record(np.array([[10.0, 9.0], [10.0, 10.0], [10.0, 11.0]]))
    assert chooser.decide().tolist() == [LEAST_LOADED, EVEN, EVEN]
    assert chooser.decide().tolist() == [EVEN, EVEN, EVEN]  # nothing measured since: even


def test_slot_sources_copy_locally_when_they_can_and_spread_remote_reads():
    # 2 ranks x 3 slots. Old: rank 0 {0, 1, 2}, rank 1 {3, 0, 1}; new: rank 0 {0, 3, 3}, rank 1 {1, 2, 0}
    old = np.array([0, 1, 2, 3, 0, 1])
    new = np.array([0, 3, 3, 1, 2, 0])
    src = slot_sources(old, new, 2)
    assert src.src_rank.tolist() == [[0, 1, 1], [1, 0, 1]]
    assert src.src_slot.tolist() == [[0, 0, 0], [2, 2, 1]]
    assert src.num_remote == 3
    assert [a.tolist() for a in src.sends(1, 0)] == [[0, 0], [1, 2]]  # rank 1 sends its slot 0 twice
    assert [a.tolist() for a in src.sends(0, 1)] == [[2], [1]]
    with pytest.raises(AssertionError, match="held nowhere"):
        slot_sources(np.array([0, 0]), np.array([0, 1]), 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 9), st.integers(1, 4), st.integers(0, 10_000))
def test_dispatch_layout_brings_every_pair_back_to_its_place(num_ranks, num_tokens, top_k, seed):
    """Simulate the exchanges between ``num_ranks`` home ranks and check that each pair's output
    lands at row_of_pair, computed by the slot it was sent to."""
    rng = np.random.default_rng(seed)
    slots_per_rank, hidden = 3, 5
    xs = [torch.randn(num_tokens, hidden) for _ in range(num_ranks)]
    layouts, dests, locals_ = [], [], []
    for h in range(num_ranks):
        dest = rng.integers(0, num_ranks, num_tokens * top_k)
        local = rng.integers(0, slots_per_rank, num_tokens * top_k)
        dests.append(dest)
        locals_.append(local)
        layouts.append(plan_dispatch(dest, local, num_tokens, top_k, num_ranks))
    sends = [pack_rows(xs[h], layouts[h]) for h in range(num_ranks)]
    back = {}
    for r in range(num_ranks):  # rank r receives from every home rank, in rank order
        parts, rows_in = [], []
        for h in range(num_ranks):
            first = sum(layouts[h].rows_per_rank[:r])
            parts.append(sends[h][first : first + layouts[h].rows_per_rank[r]])
            rows_in.append(layouts[h].rows_per_rank[r])
        got = unpack_rows(torch.cat(parts), rows_in, hidden)
        assert got.pairs_from_rank == [layouts[h].pairs_per_rank[r] for h in range(num_ranks)]
        # "expert" of slot s at rank r: x * (10 r + s + 1)
        out = got.x[got.pair_row] * torch.from_numpy(10.0 * r + got.pair_slot + 1)[:, None].float()
        edges = np.cumsum([0, *got.pairs_from_rank])
        for h in range(num_ranks):
            back[h, r] = out[edges[h] : edges[h + 1]]
    for h in range(num_ranks):
        combined = torch.cat([back[h, r] for r in range(num_ranks)])
        assert combined.shape[0] == num_tokens * top_k
        rows = combined[layouts[h].row_of_pair]
        token = np.arange(num_tokens * top_k) // top_k
        factor = torch.from_numpy(10.0 * dests[h] + locals_[h] + 1).float()[:, None]
        assert torch.equal(rows, xs[h][token] * factor)


def test_ep1_in_process_equals_the_plain_model():
    """EP = 1 through the EP layers (no torch.distributed), with redundant slots, a re-placement
    and the measured replica rule: bitwise the plain model."""
    from deepinfer.engine.parallel.expert_parallel import EpSettings, ExpertParallel
    from deepinfer.engine.parallel.group import EpGroup

    torch.set_num_threads(1)
    plain = harness.v4_runner(num_seqs=8)
    work = harness.workload(plain.config.vocab_size)
    ref = harness.run_lockstep(plain, work, list(range(8)))
    runner = harness.v4_runner(num_seqs=8)
    ep = ExpertParallel(runner.model, EpGroup.single(), EpSettings(redundant_per_rank=3, window=2, sample_every=1,
                                                                   rule_period=3))
    start = ep.phy2log.copy()
    got = harness.run_lockstep(runner, work, list(range(8)), ep.begin_step, ep.idle_step)
    assert ep.num_replacements == 1
    # the figures /metrics shows: every layer swapped is one whose placement changed
    st = ep.stats()
    assert st["num_replacements"] == 1 and st["num_steps"] == ep.num_steps > 0 and st["replacement_off"] == 0
    assert st["num_layers_swapped"] == int((ep.phy2log != start).any(axis=1).sum())
    assert st["num_replacements_done"] + st["replacement_in_flight"] == 1
    if st["num_replacements_done"]:  # one rank: the plan's imbalance is 1 (it may change no layer)
        assert st["planned_imbalance"] == pytest.approx(1.0)
    for i, (tokens, rows) in ref.items():
        assert got[i][0] == tokens and torch.equal(got[i][1], rows)


def test_a_failed_replacement_turns_replacement_off_and_serving_goes_on(caplog):
    """A planner that fails: the step loop gets no error, every token and logit equals the plain
    model's, the placement in service is the static one, and no second re-placement starts."""
    from deepinfer.engine.parallel.expert_parallel import EpSettings, ExpertParallel
    from deepinfer.engine.parallel.group import EpGroup

    torch.set_num_threads(1)
    plain = harness.v4_runner(num_seqs=4)
    work = harness.workload(plain.config.vocab_size)
    ref = harness.run_lockstep(plain, work, list(range(4)))
    runner = harness.v4_runner(num_seqs=4)
    calls = []

    def broken_planner(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("planner out of memory")

    ep = ExpertParallel(runner.model, EpGroup.single(), EpSettings(redundant_per_rank=3, window=2, period=3),
                        planner=broken_planner)
    start = ep.phy2log.copy()
    with caplog.at_level("ERROR"):
        got = harness.run_lockstep(runner, work, list(range(4)), ep.begin_step, ep.idle_step)
    assert calls == [1] and ep.num_replacements == 1 and ep.replacement is None
    assert "planner out of memory" in ep.replacement_error
    st = ep.stats()
    assert st["replacement_off"] == 1 and st["replacement_in_flight"] == 0
    assert st["num_layers_swapped"] == st["num_replacements_done"] == 0 and st["num_replacements"] == 1
    assert any("re-placement is off" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(ep.phy2log, start)
    for i, (tokens, rows) in ref.items():
        assert got[i][0] == tokens and torch.equal(got[i][1], rows)
    ep.close()


def test_planner_process_plans_as_the_planner_does_and_reports_failures():
    from deepinfer.engine.parallel.eplb import plan, static_placement
    from deepinfer.engine.parallel.planner_process import PlannerError, PlannerProcess

    rng = np.random.default_rng(4)
    history = rng.poisson(20.0, (30, 3, 16)).astype(float)
    current = static_placement(3, 16, 24, 4)
    child = PlannerProcess()
    try:
        got = child(history.sum(0), 24, 4, history=history, current=current)
        assert np.array_equal(got, plan(history.sum(0), 24, 4, history=history, current=current))
        with pytest.raises(PlannerError, match="do not split over 4 GPUs"):
            child(history.sum(0), 25, 4)
        assert np.array_equal(child(history.sum(0), 24, 4), plan(history.sum(0), 24, 4))  # still serving
        first = child._proc
        first.kill()
        first.wait()
        # a child found dead is replaced at the next plan
        assert np.array_equal(child(history.sum(0), 24, 4), plan(history.sum(0), 24, 4))
        assert child._proc.pid != first.pid
    finally:
        child.close()


def test_background_settings_are_checked_and_name_what_was_wrong():
    from deepinfer.engine.parallel.settings import EpSettings, EpSettingsError

    with pytest.raises(EpSettingsError, match="background_duty"):
        EpSettings(background_duty=0.0)
    with pytest.raises(EpSettingsError, match="background_duty"):
        EpSettings(background_duty=1.5)
    with pytest.raises(EpSettingsError, match="background_cpus"):
        EpSettings(background_cpus=(-1,))
    assert EpSettings(background_cpus=[0, 1]).background_cpus == (0, 1)  # a JSON list becomes a tuple


@pytest.mark.timeout(120)
def test_paced_pinned_replacement_keeps_tokens_and_pins_its_thread_and_planner():
    import os
    import threading

    from deepinfer.engine.parallel import replacement as replacement_module
    from deepinfer.engine.parallel.expert_parallel import EpSettings, ExpertParallel
    from deepinfer.engine.parallel.group import EpGroup

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    plain = harness.v4_runner(num_seqs=4)
    work = harness.workload(plain.config.vocab_size)
    ref = harness.run_lockstep(plain, work, list(range(4)))
    runner = harness.v4_runner(num_seqs=4)
    with pytest.raises(ValueError, match="background_cpus"):
        ExpertParallel(runner.model, EpGroup.single(), EpSettings(background_cpus=((os.cpu_count() or 1) + 64,)))
    pinned: list[set[int]] = []
    real_pin = replacement_module.pin_thread

    def spy(cpus):  # the staging thread's affinity right after it pinned itself
        real_pin(cpus)
        pinned.append(os.sched_getaffinity(threading.get_native_id()))

    replacement_module.pin_thread = spy
    try:
        ep = ExpertParallel(runner.model, EpGroup.single(),
                            EpSettings(redundant_per_rank=3, window=2, period=4, background_duty=0.5,
                                       background_cpus=(cpu,)))
        got = harness.run_lockstep(runner, work, list(range(4)), ep.begin_step, ep.idle_step)
    finally:
        replacement_module.pin_thread = real_pin
    assert ep.num_replacements >= 1 and pinned and all(p == {cpu} for p in pinned)
    for i, (tokens, rows) in ref.items():
        assert got[i][0] == tokens and torch.equal(got[i][1], rows)
    ep.close()


def test_pace_pauses_for_the_share_of_wall_time_not_given_to_background_work():
    import time

    from deepinfer.engine.parallel.replacement import Replacement

    paced = Replacement(None, [], None, None, 16, nice=0, duty=0.25)
    started = time.perf_counter()
    while time.perf_counter() - started < 0.02:  # 20 ms of work
        pass
    paced._pace(started)
    assert time.perf_counter() - started >= 0.02 / 0.25 * 0.95  # worked a quarter of the time


@pytest.mark.timeout(60)
def test_planner_child_runs_on_the_cpus_it_was_given():
    import os

    from deepinfer.engine.parallel.eplb import plan
    from deepinfer.engine.parallel.planner_process import PlannerProcess

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    child = PlannerProcess(nice=0, cpus=(cpu,))
    try:
        load = np.arange(3 * 16, dtype=float).reshape(3, 16)
        assert np.array_equal(child(load, 24, 4), plan(load, 24, 4))
        # every thread of the child (numpy's BLAS pool included) runs on those CPUs at that priority
        tasks = os.listdir(f"/proc/{child._proc.pid}/task")
        for task in tasks:
            assert os.sched_getaffinity(int(task)) == {cpu}
    finally:
        child.close()
    child = PlannerProcess(nice=7, cpus=(cpu,))
    try:
        assert np.array_equal(child(load, 24, 4), plan(load, 24, 4))
        for task in os.listdir(f"/proc/{child._proc.pid}/task"):
            with open(f"/proc/{child._proc.pid}/task/{task}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: the nice value
            assert nice == os.nice(0) + 7 or nice == 19
    finally:
        child.close()
