"""The SPS calibration's fit (engine/spec/sps_fit.py), the drafter gate (schedule "throughput") and the accepted-length floor (schedule "confidence")."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from deepinfer.engine.spec.decoding import SpecConfig
from deepinfer.engine.spec.length_policy import SCHEDULES, make_length_policy
from deepinfer.engine.spec.length_schedule import schedule_lengths
from deepinfer.engine.spec.sps_fit import fit_line, fit_step_table
from deepinfer.engine.spec.sps_profile import SpsProfile

pytestmark = pytest.mark.timeout(30)


def _noisy(true, rng, bursts):
    """Five timings of ``true`` seconds: small jitter, and a burst (x 1.5 .. 3) in ``bursts`` of them."""
    ts = [true * (1 + rng.uniform(0, 0.03)) for _ in range(5)]
    for i in rng.sample(range(5), bursts):
        ts[i] *= rng.uniform(1.5, 3.0)
    return ts


def test_line_fit_recovers_the_cost_under_bursts_of_load():
    rng = random.Random(1)
    for _ in range(50):
        a, b = rng.uniform(1e-3, 1e-2), rng.uniform(1e-5, 1e-4)
        points = {bt: _noisy(a + b * bt, rng, rng.randint(0, 2)) for bt in (60, 120, 240, 360)}
        line = fit_line(points)
        # medians ignore a minority of bursts: the slope / intercept ratio (what the scheduler uses) holds
        assert line.intercept == pytest.approx(a, rel=0.1, abs=3e-4)
        assert line.slope == pytest.approx(b, rel=0.1)


def test_fit_is_monotone_and_non_negative():
    assert fit_line({1: [2e-3], 2: [1e-3, 1e-3]}).slope == 0.0  # noise that made more tokens faster
    through_origin = fit_line({10: [1e-3], 20: [2.5e-3]})
    assert through_origin.intercept == 0.0 and through_origin.slope > 0
    fitted, lines = fit_step_table({4: {4: [1e-3], 8: [1.5e-3], 24: [3.5e-3]}})
    assert fitted[4][8] == pytest.approx(lines[4](8))
    assert SpsProfile.from_table(fitted[4]).is_step_time_convex
    with pytest.raises(ValueError, match="at least one timing"):
        fit_line({4: []})


def test_default_schedule_keeps_the_expected_length_floor():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.2, 0.95, size=(16, 5))
    steep = SpsProfile.from_table({16: 1e-3, 96: 1e-2})  # verify tokens cost a lot: the optimum cuts deep
    free = schedule_lengths(conf, steep)
    everything = schedule_lengths(conf, steep, min_share=1.0)
    bounded = schedule_lengths(conf, steep, min_share=0.95)
    assert free.expected_tokens < 0.95 * everything.expected_tokens
    assert bounded.expected_tokens >= 0.95 * everything.expected_tokens - 1e-9
    assert bounded.num_verify_tokens < everything.num_verify_tokens  # the low-survival tail is still cut
    # the engine's policies: "confidence" (the default) holds the floor, "throughput" does not
    policy = make_length_policy("confidence", steep)(conf)
    assert policy.lengths.tolist() == bounded.lengths.tolist()
    assert make_length_policy("throughput", steep)(conf).lengths.tolist() == free.lengths.tolist()
    assert SpecConfig().schedule == SCHEDULES[0] == "confidence"


def _request(rid, anchor):
    from deepinfer.engine.core.request import RequestStatus

    return SimpleNamespace(request_id=rid, status=RequestStatus.RUNNING, num_output_tokens=3, num_output_placeholders=0,
                           is_awaiting_verification=False, num_computed_tokens=anchor + 1, num_tokens=anchor + 2,
                           sampling_params=SimpleNamespace(max_tokens=100), max_model_len=1000, spec_token_ids=[])


def _spec(per_token_s, draft_s, schedule="throughput"):
    from deepinfer.engine.spec.decoding import SpecConfig, SpecDecoding, _Fresh
    from deepinfer.engine.spec.sps_table import SpsTable

    steps = {r: {r * (1 + d): 1e-3 + per_token_s * r * (1 + d) for d in (0, 5)} for r in (1, 8)}
    table = SpsTable(steps, {1: draft_s, 8: draft_s}, max_depth=5)
    proposer = SimpleNamespace(model=SimpleNamespace(block_size=5))
    spec = SpecDecoding(proposer, table, SpecConfig(schedule=schedule))
    reqs = {f"r{i}": _request(f"r{i}", 10) for i in range(8)}
    for rid in reqs:
        spec._fresh[rid] = _Fresh(10, [1, 2, 3, 4, 5], np.full(5, 0.9))
    return spec, reqs


def test_drafter_gate_drafts_when_it_pays_and_probes_when_it_does_not():
    spec, reqs = _spec(per_token_s=1e-6, draft_s=1e-4)  # cheap verify tokens, cheap drafter
    assert spec.plan_lengths(reqs, list(reqs.values()))
    assert all(len(r.spec_token_ids) == 5 for r in reqs.values())
    spec, reqs = _spec(per_token_s=1e-3, draft_s=5e-3)  # compute bound, costly drafter: plain decode wins
    gates = []
    for step in range(12):
        for r in reqs.values():  # the drafts are stale from the second step on (nothing drafted)
            r.num_computed_tokens, r.num_tokens = 11 + step, 12 + step
        gates.append(spec.plan_lengths(reqs, list(reqs.values())))
        # with the gate closed nothing is verified, fresh drafts (step 0) included
        assert all(r.spec_token_ids == [] for r in reqs.values())
    # skip 1, probe, skip 2, probe, skip 4, probe, ...: the probe interval doubles
    assert gates[:9] == [False, True, False, False, True, False, False, False, False]
    assert gates[9] is True
    fixed, reqs = _spec(per_token_s=1e-3, draft_s=5e-3, schedule="fixed")
    assert fixed.plan_lengths(reqs, list(reqs.values()))  # fixed-5 always drafts
    # the default schedule drafts every step too, and verifies at least the floor's share of E
    sched, reqs = _spec(per_token_s=1e-3, draft_s=5e-3, schedule="confidence")
    for step in range(3):
        assert sched.plan_lengths(reqs, list(reqs.values()))
        assert all(len(r.spec_token_ids) >= 1 for r in reqs.values())


def test_a_probes_drafts_are_verified_only_when_drafting_pays():
    """A probe's proposals bring fresh confidences; the next step verifies them only if the gate's
    test on those confidences passes (then the gate opens), else it verifies nothing."""
    # cheap verify tokens: the drafts, once drafted, would pay for their verification; whether
    # drafting pays is the drafter's cost
    for draft_s, verifies in ((1e-4, True), (5e-2, False)):
        spec, reqs = _spec(per_token_s=1e-4, draft_s=draft_s)
        runs = spec.plan_lengths(reqs, list(reqs.values()))
        assert runs is verifies
        assert all(bool(r.spec_token_ids) is verifies for r in reqs.values())


def test_drafter_gate_memoises_its_test_until_an_input_changes():
    """The gate's test is computed once for the same confidences, requests and caps (it decides
    every step), and again when any of them changes; its answers equal an unmemoised gate's."""
    spec, reqs = _spec(per_token_s=1e-3, draft_s=5e-3)
    fresh_spec, _ = _spec(per_token_s=1e-3, draft_s=5e-3)
    decoding = [(r, spec._fresh[r.request_id]) for r in reqs.values()]
    confs = [spec._fresh[r.request_id].confidence for r in reqs.values()]
    answers = [spec._drafting_pays(decoding, confs) for _ in range(5)]
    assert spec.num_gate_tests == 1 and answers == [answers[0]] * 5
    spec._epoch += 1  # a commit brought proposals
    spec._drafting_pays(decoding, confs)
    assert spec.num_gate_tests == 2
    spec._drafting_pays(decoding[:5], confs[:5])  # another decoding set
    assert spec.num_gate_tests == 3
    near_end = next(iter(reqs.values()))
    near_end.num_output_tokens = 98  # a cap changes: 1 draft left
    got = spec._drafting_pays(decoding, confs)
    assert spec.num_gate_tests == 4 and got == fresh_spec._drafting_pays(decoding, confs)


def test_verify_buckets_move_to_the_better_neighbouring_bucket():
    """A graphed runner's verify steps: the token total moves to a ``shape_bucket`` size (four per
    octave, at most 25 % above from 16 up): the one above, filled with the highest-survival
    candidates not yet chosen, or the one below, the lowest-survival chosen ones dropped, whichever
    has the better E x SPS(B) among those keeping the policy's accepted-length floor; never past a
    request's cap; fixed is never padded."""
    from deepinfer.engine.core.cuda_graphs import shape_bucket as verify_bucket
    from deepinfer.engine.spec.length_schedule import fill_budget

    last = 0
    for tokens in range(1, 700):
        b = verify_bucket(tokens)
        assert b >= tokens and b >= last and verify_bucket(b) == b
        assert tokens < 16 or b <= 1.25 * tokens
        last = b
    assert len({verify_bucket(t) for t in range(16, 513)}) == 21  # 16, then four per octave up to 512
    buckets = sorted({verify_bucket(t) for t in range(1, 200)})
    rng = np.random.default_rng(3)
    moved = {"up": 0, "down": 0}
    for per_token_s in (1e-6, 3e-5, 1e-4, 1e-3):  # verify tokens nearly free (a GPU) .. dear (this CPU)
        spec, _ = _spec(per_token_s=per_token_s, draft_s=5e-3, schedule="confidence")
        sps = spec.sps.profile(8)
        for _ in range(60):
            num = int(rng.integers(1, 9))
            conf = rng.uniform(0.05, 0.99, size=(num, 5))
            caps = rng.integers(0, 6, size=num)
            chosen = spec.policy.__class__(sps, min_share=spec.policy.min_share)(conf, max_lengths=caps).lengths
            k = int(chosen.sum())
            got = spec._padded(conf, caps, chosen, sps)
            total = num + int(got.sum())
            assert (got <= caps).all()
            # a prefix of the one global order: the fill of its own size
            assert got.tolist() == fill_budget(conf, sps, total - num, max_lengths=caps).lengths.tolist()
            everything = fill_budget(conf, sps, int(caps.sum()), max_lengths=caps).expected_tokens
            e = fill_budget(conf, sps, total - num, max_lengths=caps).expected_tokens
            assert e >= 0.95 * everything - 1e-9  # the default's floor holds
            up = min(verify_bucket(num + k), num + int(caps.sum()))
            below = max([b for b in buckets if b <= num + k] or [0])
            assert total in (num + k, up, below)
            if total != num + k:
                moved["up" if total > num + k else "down"] += 1
                # no feasible neighbour is better by the schedule's objective
                for other in (up, below):
                    if other < num or other == total:
                        continue
                    alt = fill_budget(conf, sps, other - num, max_lengths=caps)
                    if alt.expected_tokens >= 0.95 * everything - 1e-9:
                        f = fill_budget(conf, sps, total - num, max_lengths=caps).expected_tokens_per_s
                        assert f >= alt.expected_tokens_per_s - 1e-9
    assert moved["up"] and moved["down"]  # both directions were taken
    fixed, _ = _spec(per_token_s=1e-3, draft_s=5e-3, schedule="fixed")
    assert not fixed.pad_to_buckets
