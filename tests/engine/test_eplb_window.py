"""EPLB statistics and schedule: the sliding window, the re-placement schedule, the rebalancer."""

import numpy as np
import pytest

from deepinfer.engine.parallel.eplb import (
    DECODE,
    PREFILL,
    EplbConfig,
    ExpertLoadWindow,
    ExpertRebalancer,
    ReplacementSchedule,
    check_placement,
    static_placement,
)


@pytest.mark.timeout(120)
def test_window_keeps_the_last_steps_in_order():
    rng = np.random.default_rng(0)
    steps = rng.integers(0, 50, (23, 2, 5)).astype(float)
    window = ExpertLoadWindow(num_layers=2, num_logical=5, window=7)
    for t, counts in enumerate(steps):
        window.record(counts)
        first = max(0, t + 1 - 7)
        assert window.num_steps == t + 1 and window.is_full == (t + 1 >= 7)
        np.testing.assert_array_equal(window.history(), steps[first : t + 1])
        np.testing.assert_allclose(window.total(), steps[first : t + 1].sum(axis=0))


@pytest.mark.timeout(120)
def test_window_total_stays_exact_over_many_steps():
    # the running total adds and subtracts; integer counts stay exact in float64
    rng = np.random.default_rng(1)
    window = ExpertLoadWindow(1, 3, window=10)
    steps = rng.integers(0, 10**6, (5000, 1, 3)).astype(float)
    for counts in steps:
        window.record(counts)
    np.testing.assert_array_equal(window.total(), steps[-10:].sum(axis=0))


@pytest.mark.timeout(120)
def test_window_rejects_bad_counts():
    window = ExpertLoadWindow(2, 4, window=3)
    with pytest.raises(AssertionError, match="counts must be"):
        window.record(np.zeros((4, 2)))
    with pytest.raises(AssertionError, match="non-negative"):
        window.record(-np.ones((2, 4)))
    with pytest.raises(AssertionError, match="at least one step"):
        ExpertLoadWindow(2, 4, window=0)


def planned_steps(schedule, num_steps, imbalance_at=lambda n: 1.0):
    """Drive a schedule as the rebalancer does: the steps that planned."""
    due = []
    for n in range(1, num_steps):
        if schedule.is_due(n) or (schedule.checks_drift(n) and schedule.has_drifted(imbalance_at(n))):
            due.append(n)
            schedule.planned(n, 1.0)
    return due


@pytest.mark.timeout(120)
def test_schedule_plans_when_the_window_fills_then_every_period():
    assert planned_steps(ReplacementSchedule(window=100, period=1000), 3500) == [100, 1100, 2100, 3100]
    assert planned_steps(ReplacementSchedule(window=10, period=10), 40) == [10, 20, 30]


@pytest.mark.timeout(120)
def test_schedule_plans_early_when_the_load_drifts_from_the_placement():
    # the plan left 1.0; from step 2300 the window measures 1.05 under it: beyond the 0.02 margin
    drifting = lambda n: 1.05 if n >= 2300 else 1.01  # noqa: E731
    schedule = ReplacementSchedule(window=100, period=1000, drift_margin=0.02)
    # checks every window steps after a plan: 1200 ... 2000 see 1.01; 2300 is the first over
    assert planned_steps(schedule, 3500, drifting) == [100, 1100, 2100, 2300, 2400, 2500, 2600, 2700, 2800, 2900,
                                                        3000, 3100, 3200, 3300, 3400]
    # without a margin only the period counts
    assert planned_steps(ReplacementSchedule(window=100, period=1000), 3500, drifting) == [100, 1100, 2100, 3100]
    with pytest.raises(ValueError, match="drift_margin must be >= 0"):
        EplbConfig(num_gpus=2, redundant_per_gpu=0, window=1, period=1, drift_margin=-0.1).validate(4)


@pytest.mark.timeout(120)
def test_spec_settings():
    assert EplbConfig(num_gpus=4, **PREFILL).num_physical(256) == 256 + 16
    decode = EplbConfig(num_gpus=64, **DECODE)
    assert (decode.window, decode.period, decode.num_physical(256)) == (1000, 10000, 320)


@pytest.mark.timeout(120)
def test_rebalancer_plans_from_the_window_on_schedule():
    calls = []

    def recording_planner(load, num_physical, num_gpus, num_nodes, *, history, current):
        calls.append((load.copy(), history.copy(), current.copy()))
        # a valid placement that differs from the start-up one: experts reversed
        return static_placement(load.shape[0], load.shape[1], num_physical, num_gpus)[:, ::-1].copy()

    cfg = EplbConfig(num_gpus=2, redundant_per_gpu=1, window=3, period=4, drift_margin=0.0)
    balancer = ExpertRebalancer(cfg, num_layers=1, num_logical=4, planner=recording_planner)
    start = balancer.phy2log.copy()
    np.testing.assert_array_equal(start, static_placement(1, 4, 6, 2))
    steps = np.arange(10 * 4, dtype=float).reshape(10, 1, 4)
    results = [balancer.observe(s) for s in steps]
    assert [i + 1 for i, r in enumerate(results) if r is not None] == [3, 7]  # window, window + period
    assert balancer.num_plans == 2
    np.testing.assert_array_equal(calls[0][0], steps[0:3].sum(axis=0))
    np.testing.assert_array_equal(calls[1][1], steps[4:7])
    np.testing.assert_array_equal(calls[0][2], start)  # the placement in service goes along
    np.testing.assert_array_equal(calls[1][2], results[2])


@pytest.mark.timeout(120)
def test_rebalancer_with_the_real_planner_balances_a_skewed_load():
    rng = np.random.default_rng(2)
    popularity = rng.zipf(1.5, 32).astype(float)
    cfg = EplbConfig(num_gpus=4, redundant_per_gpu=2, window=20, period=50)
    balancer = ExpertRebalancer(cfg, num_layers=2, num_logical=32)
    for _ in range(20):
        balancer.observe(rng.poisson(np.tile(popularity * 50, (2, 1))).astype(float))
    check_placement(balancer.phy2log, 32, 4)
    assert balancer.num_plans == 1 and not (balancer.phy2log == static_placement(2, 32, 40, 4)).all()


@pytest.mark.timeout(120)
def test_rebalancer_rejects_settings_that_do_not_fit():
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertRebalancer(EplbConfig(num_gpus=3, redundant_per_gpu=1, window=1, period=1), 1, 8)
    with pytest.raises(ValueError, match="window and period"):
        ExpertRebalancer(EplbConfig(num_gpus=2, redundant_per_gpu=1, window=0, period=1), 1, 8)
    with pytest.raises(ValueError, match="nodes"):
        ExpertRebalancer(EplbConfig(num_gpus=4, redundant_per_gpu=1, window=1, period=1, num_nodes=3), 1, 8)
