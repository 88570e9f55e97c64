"""DSpark's verify-length scheduler (engine/spec): exactness against brute force, the early-stop
rules, monotonicity, the fixed policy, edge cases, the two-steps-old budget and the SPS profile."""

import importlib
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.spec import (
    ConfidencePolicy,
    FixedPolicy,
    SpsProfile,
    expected_tokens,
    fill_budget,
    make_length_policy,
    schedule_exhaustive,
    schedule_fixed,
    schedule_lengths,
    survival,
)
from tests.conftest import load_bench_module, load_bench_package

CONVEX = SpsProfile.from_table({1: 0.010, 8: 0.010, 16: 0.0102, 24: 0.0108, 40: 0.0125})


def linear(t0: float, per_token: float):
    return lambda b: 1.0 / (t0 + per_token * b)


# ---- strategies -----------------------------------------------------------------------------
PROB = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.9]), st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def batches(draw, max_requests=4, max_drafts=4):
    num_requests = draw(st.integers(0, max_requests))
    num_drafts = draw(st.integers(0, max_drafts))
    conf = draw(st.lists(PROB, min_size=num_requests * num_drafts, max_size=num_requests * num_drafts))
    return np.array(conf, dtype=float).reshape(num_requests, num_drafts)


@st.composite
def profiles(draw):
    """A measured table: random points, possibly non-convex; from_points makes it monotone."""
    xs = sorted(draw(st.sets(st.integers(1, 30), min_size=1, max_size=5)))
    ts = draw(st.lists(st.floats(0.001, 0.05), min_size=len(xs), max_size=len(xs)))
    return SpsProfile.from_points(zip(xs, ts))


@st.composite
def step_sps(draw):
    """A plain callable SPS that is non-increasing but has plateaus and cliffs (not convex)."""
    cliffs = sorted(draw(st.lists(st.integers(1, 25), max_size=3)))
    drops = draw(st.lists(st.floats(0.3, 1.0), min_size=len(cliffs), max_size=len(cliffs)))
    def sps(b):
        rate = 100.0
        for cliff, drop in zip(cliffs, drops):
            if b > cliff:
                rate *= drop
        return rate
    return sps


def assert_same_objective(got, want):
    assert got.expected_tokens_per_s == pytest.approx(want.expected_tokens_per_s, rel=1e-9, abs=1e-12)


def assert_consistent(sched, conf, sps):
    """The reported figures are those of the lengths it returns."""
    surv = survival(conf)
    assert sched.num_verify_tokens == len(sched.lengths) + int(sched.lengths.sum())
    assert sched.expected_tokens == pytest.approx(expected_tokens(surv, sched.lengths))
    if len(sched.lengths):
        assert sched.steps_per_s == pytest.approx(sps(sched.num_verify_tokens))


# ---- greedy == exhaustive -------------------------------------------------------------------
@settings(max_examples=200, deadline=None, derandomize=True)
@given(batches(), profiles(), st.data())
def test_greedy_equals_exhaustive_on_profiles(conf, profile, data):
    num_requests, num_drafts = conf.shape
    caps = data.draw(st.none() | st.lists(st.integers(0, 6), min_size=num_requests, max_size=num_requests))
    cap_b = data.draw(st.none() | st.integers(num_requests, num_requests * (num_drafts + 1) + 2))
    want = schedule_exhaustive(conf, profile, max_lengths=caps, max_verify_tokens=cap_b)
    for early_stop in (True, False):
        got = schedule_lengths(conf, profile, max_lengths=caps, max_verify_tokens=cap_b, early_stop=early_stop)
        assert_same_objective(got, want)
        assert_consistent(got, conf, profile)
        if caps is not None:
            assert np.all(got.lengths <= np.minimum(caps, num_drafts))
        if cap_b is not None:
            assert got.num_verify_tokens <= cap_b


@settings(max_examples=200, deadline=None, derandomize=True)
@given(batches(), step_sps())
def test_greedy_equals_exhaustive_on_step_shaped_callables(conf, sps):
    # a callable is not known to be convex: only the bound rule may stop the scan early
    want = schedule_exhaustive(conf, sps)
    got = schedule_lengths(conf, sps)
    assert_same_objective(got, want)
    assert_consistent(got, conf, sps)


def test_first_decrease_is_not_final_without_convex_step_time():
    # one request, survival 0.9 at every depth; SPS halves past B = 2 and is flat after:
    # f(L) = 1.0, 1.9, 1.4, 1.85, 2.3, 2.75 -> the dip at L = 2 is not the end
    conf = np.array([[0.9, 1.0, 1.0, 1.0, 1.0]])
    profile = SpsProfile.from_table({2: 1.0, 3: 2.0, 6: 2.0})
    assert not profile.is_step_time_convex
    fs = [expected_tokens(survival(conf), [n]) * profile(1 + n) for n in range(6)]
    assert fs[2] < fs[1] < fs[5]
    for sps in (profile, lambda b: 1.0 if b <= 2 else 0.5):
        assert schedule_lengths(conf, sps).lengths.tolist() == [5]


def test_first_decrease_stop_on_convex_profile_matches_full_scan():
    rng = np.random.default_rng(3)
    assert CONVEX.is_step_time_convex
    for _ in range(50):
        conf = rng.uniform(0.2, 1.0, size=(6, 5))
        a = schedule_lengths(conf, CONVEX)
        b = schedule_lengths(conf, CONVEX, early_stop=False)
        assert a.lengths.tolist() == b.lengths.tolist()


# ---- structure and monotonicity -------------------------------------------------------------
@settings(max_examples=200, deadline=None, derandomize=True)
@given(batches(max_requests=6, max_drafts=5), profiles())
def test_admitted_candidates_dominate_the_rest(conf, profile):
    sched = schedule_lengths(conf, profile)
    surv = survival(conf)
    taken = [surv[r, j] for r in range(len(conf)) for j in range(sched.lengths[r])]
    left = [surv[r, j] for r in range(len(conf)) for j in range(sched.lengths[r], conf.shape[1])]
    if taken and left:
        assert min(taken) >= max(left)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batches(max_requests=6, max_drafts=5), st.floats(1e-5, 1e-3), st.floats(1.0, 20.0))
def test_costlier_tokens_never_verify_more(conf, per_token, factor):
    # t(B) = t0 + lambda B: log f has decreasing differences in (B, lambda), so the smallest
    # maximiser (the one the scheduler returns) cannot grow when tokens get dearer
    cheap = schedule_lengths(conf, linear(0.01, per_token))
    dear = schedule_lengths(conf, linear(0.01, per_token * factor))
    assert dear.num_verify_tokens <= cheap.num_verify_tokens


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batches(max_requests=4, max_drafts=4), profiles(), st.data())
def test_higher_confidence_never_lowers_the_objective(conf, profile, data):
    if conf.size == 0:
        return
    bumped = conf.copy()
    r, j = data.draw(st.integers(0, conf.shape[0] - 1)), data.draw(st.integers(0, conf.shape[1] - 1))
    bumped[r, j] = data.draw(st.floats(conf[r, j], 1.0))
    before = schedule_lengths(conf, profile).expected_tokens_per_s
    assert schedule_lengths(bumped, profile).expected_tokens_per_s >= before * (1 - 1e-12)


def test_more_drafts_never_lower_the_objective():
    rng = np.random.default_rng(5)
    for _ in range(30):
        conf = rng.uniform(0, 1, size=(8, 5))
        objectives = [schedule_lengths(conf[:, :d], CONVEX).expected_tokens_per_s for d in range(6)]
        assert objectives == sorted(objectives)


def test_flat_sps_verifies_every_candidate_that_can_survive():
    conf = np.array([[0.5, 0.0, 0.9], [1.0, 1.0, 0.2], [0.0, 0.7, 0.7]])
    sched = schedule_lengths(conf, lambda b: 10.0)
    assert sched.lengths.tolist() == [1, 3, 0]  # zero survival is never worth a token


def test_steeper_profile_cuts_low_survival_drafts_first():
    # 3 requests: confident, middling, hopeless. Dear tokens: only the confident prefix survives
    conf = np.array([[0.95] * 5, [0.6] * 5, [0.1] * 5])
    cheap = schedule_lengths(conf, linear(0.010, 1e-9))
    dear = schedule_lengths(conf, linear(0.010, 2e-3))
    assert cheap.lengths.tolist() == [5, 5, 5]
    assert dear.lengths[0] >= dear.lengths[1] >= dear.lengths[2]
    assert dear.num_verify_tokens < cheap.num_verify_tokens


# ---- fixed policy ---------------------------------------------------------------------------
def test_fixed_policy_verifies_all_drafts():
    conf = np.full((4, 5), 0.5)
    sched = schedule_fixed(conf, CONVEX)
    assert sched.lengths.tolist() == [5] * 4
    assert sched.num_verify_tokens == 24
    assert sched.expected_tokens == pytest.approx(4 * (1 + sum(0.5**k for k in range(1, 6))))
    assert sched.steps_per_s == pytest.approx(CONVEX(24))
    assert schedule_fixed(conf, CONVEX, num_drafts=2, max_lengths=[5, 1, 0, 3]).lengths.tolist() == [2, 1, 0, 2]
    assert FixedPolicy(CONVEX)(conf).lengths.tolist() == [5] * 4
    with pytest.raises(ValueError, match="0..5"):
        schedule_fixed(conf, CONVEX, num_drafts=6)


# ---- edge cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [schedule_lengths, schedule_exhaustive, schedule_fixed])
def test_no_requests(schedule):
    sched = schedule(np.zeros((0, 5)), CONVEX)
    assert sched.lengths.shape == (0,) and sched.num_verify_tokens == 0
    assert sched.expected_tokens == 0.0 and sched.expected_tokens_per_s == 0.0


def test_no_drafts_is_plain_decode():
    sched = schedule_lengths(np.zeros((3, 0)), CONVEX)
    assert sched.lengths.tolist() == [0, 0, 0]
    assert (sched.num_verify_tokens, sched.expected_tokens) == (3, 3.0)


def test_all_zero_and_all_one_confidences():
    zero = schedule_lengths(np.zeros((5, 5)), CONVEX)
    assert zero.lengths.tolist() == [0] * 5 and zero.expected_tokens == 5.0
    one_flat = schedule_lengths(np.ones((5, 5)), lambda b: 1.0)
    assert one_flat.lengths.tolist() == [5] * 5 and one_flat.expected_tokens == 30.0
    # certain drafts but dear tokens: ties in survival are shared out evenly (depth first)
    one_dear = schedule_lengths(np.ones((5, 5)), CONVEX)
    assert one_dear.lengths.max() - one_dear.lengths.min() <= 1
    assert_same_objective(one_dear, schedule_exhaustive(np.ones((5, 5)), CONVEX))


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match=r"\[requests, drafts\]"):
        schedule_lengths(np.ones(5), CONVEX)
    with pytest.raises(ValueError, match="probabilities"):
        schedule_lengths(np.array([[0.5, np.nan]]), CONVEX)
    with pytest.raises(ValueError, match="probabilities"):
        schedule_lengths(np.array([[1.5]]), CONVEX)
    with pytest.raises(ValueError, match="root tokens"):
        schedule_lengths(np.ones((4, 5)), CONVEX, max_verify_tokens=3)
    with pytest.raises(ValueError, match="max_lengths"):
        schedule_lengths(np.ones((2, 5)), CONVEX, max_lengths=[1])
    with pytest.raises(ValueError, match="too large"):
        schedule_exhaustive(np.ones((12, 5)), CONVEX)
    with pytest.raises(ValueError, match="unknown spec schedule"):
        make_length_policy("greedy", CONVEX)


def test_verify_token_cap():
    sched = schedule_lengths(np.ones((4, 5)), lambda b: 1.0, max_verify_tokens=10)
    assert sched.num_verify_tokens == 10 and sched.lengths.tolist() == [2, 2, 1, 1]


# ---- fill_budget and the two-steps-old variant ----------------------------------------------
@settings(max_examples=100, deadline=None, derandomize=True)
@given(batches(max_requests=4, max_drafts=4), st.integers(0, 20))
def test_fill_budget_is_the_best_prefix_set_of_its_size(conf, budget):
    surv = survival(conf)
    sched = fill_budget(conf, CONVEX, budget)
    num_requests, num_drafts = conf.shape
    assert sched.num_draft_tokens == min(budget, conf.size)
    best = max(
        (expected_tokens(surv, combo) for combo in itertools.product(range(num_drafts + 1), repeat=num_requests)
         if sum(combo) == sched.num_draft_tokens),
        default=0.0,
    )
    assert sched.expected_tokens == pytest.approx(best)


def test_delayed_budget_uses_the_draft_count_of_two_steps_ago():
    rng = np.random.default_rng(11)
    steps = [rng.uniform(0.1, 1.0, size=(8, 5)) for _ in range(6)]
    delayed, exact = ConfidencePolicy(CONVEX, delay=2), [schedule_lengths(c, CONVEX) for c in steps]
    got = [delayed(c) for c in steps]
    assert [g.lengths.tolist() for g in got[:2]] == [e.lengths.tolist() for e in exact[:2]]
    for s in range(2, 6):
        assert got[s].num_draft_tokens == exact[s - 2].num_draft_tokens
        assert got[s].lengths.tolist() == fill_budget(steps[s], CONVEX, exact[s - 2].num_draft_tokens).lengths.tolist()
    # different budgets two steps apart make the variant differ from the exact schedule somewhere
    assert any(g.lengths.tolist() != e.lengths.tolist() for g, e in zip(got, exact))


def test_delayed_budget_equals_exact_when_confidences_hold_still():
    conf = np.random.default_rng(2).uniform(0.1, 1.0, size=(16, 5))
    delayed = ConfidencePolicy(CONVEX, delay=2)
    want = schedule_lengths(conf, CONVEX).lengths.tolist()
    assert all(delayed(conf).lengths.tolist() == want for _ in range(5))


def test_delayed_budget_scales_with_the_batch_and_respects_caps():
    conf = np.full((10, 5), 0.8)
    delayed = ConfidencePolicy(lambda b: 1.0, delay=2, max_verify_tokens=40)
    budgets = [delayed(conf).num_draft_tokens for _ in range(2)]
    assert budgets == [30, 30]  # flat SPS: everything that fits under the cap of 40
    grown = delayed(np.full((20, 5), 0.8))  # 20 requests now: budget 30 x 20/10, capped at 40 - 20
    assert grown.num_draft_tokens == 20 and grown.num_verify_tokens == 40
    shrunk = delayed(np.full((5, 5), 0.8))  # budget from 2 steps ago (30 for 10) -> 15 for 5
    assert shrunk.num_draft_tokens == 15
    delayed.reset()
    assert delayed(np.full((5, 5), 0.8)).num_draft_tokens == 25


def test_make_length_policy():
    conf = np.full((2, 5), 0.5)
    assert make_length_policy("fixed", CONVEX)(conf).lengths.tolist() == [5, 5]
    assert isinstance(make_length_policy("confidence", CONVEX, delay=2), ConfidencePolicy)


# ---- SPS profile ----------------------------------------------------------------------------
def test_profile_interpolates_step_time_and_extends_the_tail():
    p = SpsProfile.from_table({10: 0.010, 20: 0.012, 40: 0.020})
    assert p.step_seconds(1) == 0.010 and p.step_seconds(15) == pytest.approx(0.011)
    assert p.step_seconds(60) == pytest.approx(0.028)  # last slope 0.4 ms per token
    assert p(30) == pytest.approx(1 / 0.016)
    xs = np.array([0, 1, 10, 15, 20, 33, 40, 60, 1000])
    assert p.step_seconds_many(xs) == pytest.approx([p.step_seconds(x) for x in xs])
    assert p.is_step_time_convex
    assert p.shifted(0.001).step_seconds(15) == pytest.approx(0.012)


def test_profile_envelope_makes_sps_non_increasing():
    p = SpsProfile.from_points([(64, 0.015), (8, 0.010), (32, 0.009), (16, 0.011)])
    assert p.num_tokens == (8, 16, 32, 64) and p.seconds == (0.009, 0.009, 0.009, 0.015)
    rates = [p(b) for b in range(1, 200)]
    assert rates == sorted(rates, reverse=True)


def test_profile_convexity_check():
    assert not SpsProfile.from_table({1: 0.01, 10: 0.02, 20: 0.021}).is_step_time_convex
    assert SpsProfile.from_table({5: 0.01}).is_step_time_convex


def test_profile_errors():
    with pytest.raises(ValueError, match="at least one"):
        SpsProfile.from_points([])
    with pytest.raises(ValueError, match="same token count"):
        SpsProfile.from_points([(4, 0.01), (4, 0.02)])
    with pytest.raises(ValueError, match="bad SPS profile point"):
        SpsProfile.from_table({0: 0.01})
    with pytest.raises(ValueError, match="bad SPS profile point"):
        SpsProfile.from_table({4: -1.0})
    with pytest.raises(ValueError, match="non-decreasing"):
        SpsProfile((1, 2), (0.02, 0.01))


# ---- the simulated-acceptance benchmark (tests/bench/spec_sim.py) -----------------------------
@pytest.fixture(scope="module")
def spec_sim():
    load_bench_package()
    return importlib.import_module("deepinfer_bench.spec_sim")


def test_simulated_drafter_is_calibrated_and_the_schedule_pays_at_60(spec_sim):
    timing = spec_sim.StepTimeModel.fit_deepseek()
    res = spec_sim.simulate(60, 300, spec_sim.AcceptanceModel(), timing, seed=1)
    off, fixed, sched, delayed = (res[k] for k in ("off", "fixed", "confidence", "delayed"))
    assert (off.verified_per_step, off.accepted_len, fixed.verified_per_step) == (0.0, 1.0, 5.0)
    for r in (fixed, sched, delayed):  # realised vs expected committed tokens: 18,000 request-steps
        assert r.accepted_len == pytest.approx(r.expected / r.num_requests, abs=0.05)
    assert fixed.accepted_len == pytest.approx(3.29, abs=0.08)  # the curve is set to DeepSeek's fixed-5 figure
    assert sched.verified_per_step < 0.85 * fixed.verified_per_step
    assert sched.accepted_len > 0.95 * fixed.accepted_len
    assert sched.tok_s > fixed.tok_s > off.tok_s


def test_step_time_fit_reproduces_deepseeks_operating_points(spec_sim):
    t = spec_sim.StepTimeModel.fit_deepseek()
    step = lambda verified: float(t.target_s(60 * (1 + verified))) + t.draft_s(60, 5)  # noqa: E731
    assert 60 * 3.29 / step(5) == pytest.approx(13_730, rel=1e-9)
    assert 60 * 3.20 / step(3.5) == pytest.approx(14_466, rel=1e-9)
    assert t.profile(768).is_step_time_convex


def test_bench_spec_cli(spec_sim, tmp_path, capsys):
    bench = load_bench_module("spec")
    with pytest.raises(SystemExit, match="--max-tokens"):  # the engine run (default) checks its arguments first
        bench.main(["--max-tokens", "1"])
    out = tmp_path / "spec.json"
    assert bench.main(["--simulated", "--concurrency", "4,60", "--steps", "20", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["mode"] == "simulated" and figures["verified_per_step_fixed"] == 5.0
    for key in ("verified_per_step_sched", "accepted_len_fixed", "accepted_len_sched", "tok_s_off", "tok_s_fixed",
                "tok_s_sched", "c4_tok_s_delayed"):
        assert figures[key] > 0
    with pytest.raises(SystemExit, match="--curve"):
        bench.main(["--simulated", "--curve", "0.9,1.2"])
