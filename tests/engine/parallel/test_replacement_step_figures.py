"""The step-time figures of ``deepinfer bench eplb --traces steps`` on made-up step times: a
re-placement's stretch, the control over the same steps, and the means over the control."""

import numpy as np

from tests.conftest import load_bench_package


def run_of(step_ms, swaps, in_flight, control_ms):
    load_bench_package()
    from deepinfer_bench.eplb.replacement_steps import Run

    n = len(step_ms)
    return Run(np.asarray(step_ms, float), np.asarray(swaps), np.zeros(n), np.asarray(in_flight, bool), 1,
               np.asarray(control_ms, float))


def test_a_stretch_runs_from_three_steps_before_the_replacement_to_one_after_its_last_swap():
    swaps, flight = np.zeros(40, int), np.zeros(40, bool)
    flight[10:20] = True
    swaps[[13, 16, 19]] = 1  # not at consecutive boundaries: still one re-placement
    flight[30:34] = True
    swaps[33] = 1
    run = run_of(np.ones(40), swaps, flight, np.ones(40))
    assert run.stretches() == [(7, 21), (27, 35)]


def test_a_slow_step_while_planning_counts_around_the_replacement():
    from deepinfer_bench.eplb.replacement_steps import figures

    swaps, flight = np.zeros(60, int), np.zeros(60, bool)
    flight[20:40] = True  # planned at step 20, staged for 18 steps, swapped at the boundary of step 39
    swaps[39] = 1
    step_ms = np.full(60, 10.0)
    step_ms[21] = 13.0  # a step during the plan, far from the swap
    got = figures([run_of(step_ms, swaps, flight, np.full(60, 10.0))])
    assert got["replacement_max_over_median"] == 1.3 and got["control_max_over_median"] == 1.0


def test_a_stall_at_a_swap_shows_over_the_control_and_noise_shows_in_both():
    from deepinfer_bench.eplb.replacement_steps import figures

    rng = np.random.default_rng(0)
    base = 10 + rng.random(120)
    swaps, flight = np.zeros(120, int), np.zeros(120, bool)
    flight[40:50] = True
    swaps[[44, 46, 48]] = 1
    noise = base.copy()
    noise[45] = 30  # the machine, in the measured run and at the same step of the control
    quiet = figures([run_of(noise, swaps, flight, noise)])
    assert quiet["replacement_max_over_median"] > 2.5
    assert abs(quiet["replacement_max_over_median"] - quiet["control_max_over_median"]) < 0.1
    stalled = base.copy()
    stalled[46] = 25  # the step after a swap, in the measured run only
    got = figures([run_of(stalled, swaps, flight, base)])
    assert got["replacement_max_over_median"] > 2.2 and got["control_max_over_median"] < 1.2
    assert got["swap_step_mean_over_control"] > 1.4
    assert got["replacement_mean_over_control"] > 1.1


def test_a_step_overlapping_a_background_phase_is_counted_in_that_phase():
    load_bench_package()
    from deepinfer_bench.eplb.replacement_steps import figures, overlaps

    starts = np.array([0.0, 1.0, 2.0, 3.0, 4.0])  # four steps of 1 s
    assert overlaps(starts, [(1.5, 2.5)]).tolist() == [False, True, True, False]
    assert overlaps(starts, [(0.2, 0.3), (3.9, 5.0)]).tolist() == [True, False, False, True]
    n = 40
    swaps, flight = np.zeros(n, int), np.zeros(n, bool)
    flight[10:14] = True
    swaps[13] = 1
    step_ms = np.full(n, 10.0)
    pack = np.zeros(n, bool)
    pack[[11, 12]] = True
    step_ms[pack] = 15.0  # the steps the packing overlapped, slower
    run = run_of(step_ms, swaps, flight, np.full(n, 10.0))
    run.phases = {"pack": pack, "copy": np.zeros(n, bool)}
    got = figures([run])
    assert abs(got["pack_step_mean_over_control"] - 1.5) < 1e-9
    assert "copy_step_mean_over_control" not in got  # no step overlapped a copy
    assert abs(got["excess_max"] - 0.5) < 1e-9
    assert got["worst_step_in_pack"] == 1.0 and got["worst_step_in_copy"] == 0.0
    assert abs(got["worst_step_over_control_step"] - 1.5) < 1e-9


def test_rank_cores_keep_hyperthread_siblings_apart():
    load_bench_package()
    from deepinfer_bench.eplb.replacement_steps import rank_cores

    def smt(n):  # Linux numbering of an n-core, 2-thread machine: core c and c + n are siblings
        return lambda c: {c % n, c % n + n}

    cores = list(range(16))
    got = [rank_cores(cores, smt(8), 2, r) for r in range(2)]
    assert got == [[0, 1, 2], [3, 4, 5]]  # the step, the staging thread, the planner child
    assert all(len({c % 8 for c in g}) == len(g) for g in got)  # no two threads of one physical core
    adjacent = lambda c: {c - c % 2, c - c % 2 + 1}  # noqa: E731 - siblings numbered next to each other
    assert [rank_cores(cores, adjacent, 2, r) for r in range(2)] == [[0, 2, 4], [6, 8, 10]]
    alone = lambda c: {c}  # noqa: E731
    assert [rank_cores(list(range(5)), alone, 2, r) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cores([0, 1], alone, 2, r) for r in range(2)] == [[0], [1]]  # 2 cores: one each
    assert [rank_cores([0, 1, 2], alone, 2, r) for r in range(2)] == [[0], [1]]
    assert [rank_cores([0, 1], adjacent, 2, r) for r in range(2)] == [[0], [1]]  # too few physical cores
