from __future__ import annotations

import numpy as np
import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sched.cost_model import CostModel, StepFeatures, fit_coefficients, nnls
from deepinfer.engine.sched.scheduler import Scheduler, SchedulerConfig

TRUE = np.array([2e-3, 5e-5, 4e-6, 2e-10, 6e-10])  # c0, c_seq, c_tok, c_ctx, c_sq


def random_steps(rng: np.random.Generator, num: int) -> list[StepFeatures]:
    steps = []
    for _ in range(num):
        chunks = [(1, int(rng.integers(10, 20000))) for _ in range(int(rng.integers(0, 64)))]
        for _ in range(int(rng.integers(0, 3))):
            chunks.append((int(rng.integers(16, 8192)), int(rng.integers(0, 32768))))
        if not chunks:
            chunks = [(1, 100)]
        steps.append(StepFeatures.of(chunks))
    return steps


def timings(steps, coef, rng, noise):
    t = np.array([s.vector() @ coef for s in steps])
    return t * (1.0 + noise * rng.standard_normal(len(t)))


def test_fit_recovers_coefficients_exactly_without_noise():
    rng = np.random.default_rng(0)
    steps = random_steps(rng, 200)
    x = np.stack([s.vector() for s in steps])
    coef = fit_coefficients(x, timings(steps, TRUE, rng, 0.0))
    np.testing.assert_allclose(coef, TRUE, rtol=1e-6)


def test_fit_is_robust_to_noise_and_predicts_held_out_steps():
    rng = np.random.default_rng(1)
    model = CostModel(window=400, refit_every=10_000)
    for s, t in zip(steps := random_steps(rng, 300), timings(steps, TRUE, rng, 0.05)):
        model.observe(s, t)
    assert model.refit()
    assert np.all(model.coef >= 0)
    # the dominant terms come back within 10 %
    np.testing.assert_allclose(model.coef[[0, 2, 4]], TRUE[[0, 2, 4]], rtol=0.1)
    test = random_steps(rng, 200)
    pred = np.array([model.predict(s) for s in test])
    true = np.array([s.vector() @ TRUE for s in test])
    assert np.median(np.abs(pred - true) / true) < 0.03


def test_fit_keeps_coefficients_non_negative():
    # timings where an unconstrained fit gives the n*p term a negative weight
    rng = np.random.default_rng(2)
    steps = random_steps(rng, 100)
    t = np.array([s.vector() @ (TRUE * [1, 1, 1, -0.2, 1]) for s in steps])
    assert np.all(t > 0)
    coef = fit_coefficients(np.stack([s.vector() for s in steps]), t)
    assert np.all(coef >= 0)
    unconstrained, *_ = np.linalg.lstsq(np.stack([s.vector() for s in steps]) / t[:, None], np.ones_like(t), rcond=None)
    assert np.any(unconstrained < 0)


def test_nnls_matches_known_solution():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([2.0, -1.0, 1.0])
    x = nnls(a, b)
    # with x2 >= 0 the best is x2 = 0, x1 = mean(2, 1) = 1.5
    np.testing.assert_allclose(x, [1.5, 0.0])


def test_online_window_is_bounded_and_tracks_drift():
    rng = np.random.default_rng(3)
    model = CostModel(window=100, refit_every=50)
    for s in random_steps(rng, 200):
        model.observe(s, s.vector() @ TRUE)
    slower = TRUE * 2
    for s in random_steps(rng, 200):
        model.observe(s, s.vector() @ slower)
    assert len(model._recent) == 100
    np.testing.assert_allclose(model.coef, slower, rtol=1e-4)


def test_max_chunk_is_the_largest_that_fits():
    model = CostModel(TRUE)
    base = StepFeatures.of([(1, 5000)] * 32)  # 32 decodes already in the step
    for prefix in (0, 4096, 100_000):
        for target in (0.01, 0.05, 0.2):
            n = model.max_chunk(base, prefix, target, max_tokens=32768)
            fits = StepFeatures.of([(1, 5000)] * 32 + [(n, prefix)])
            assert n == 0 or model.predict(fits) <= target + 1e-12
            if n < 32768:
                over = StepFeatures.of([(1, 5000)] * 32 + [(n + 1, prefix)])
                assert model.predict(over) > target
    # a longer prefix makes each new token dearer: smaller chunk
    assert model.max_chunk(base, 100_000, 0.05, 32768) < model.max_chunk(base, 0, 0.05, 32768)
    # the token budget caps it; no time left -> 0
    assert model.max_chunk(StepFeatures(), 0, 100.0, 512) == 512
    assert model.max_chunk(base, 0, 0.001, 512) == 0


def test_bad_coefficients_rejected():
    with pytest.raises(ValueError):
        CostModel([1.0, -1.0, 0, 0, 0])


def _sched(model: CostModel, target: float, min_chunk: int = 64) -> Scheduler:
    cfg = SchedulerConfig(
        block_size=16, max_num_seqs=64, max_num_batched_tokens=32768, step_time_target_s=target, min_chunk_tokens=min_chunk
    )
    return Scheduler(cfg, BlockPool(100_000, 16), SlotPool(64), cost_model=model)


def test_scheduler_sizes_chunks_with_the_cost_model():
    model = CostModel(TRUE)
    s = _sched(model, target=0.03)
    s.add_request("long", list(range(1, 40_001)), SamplingParams(max_tokens=1), seed=0)
    out = s.schedule()
    n0 = out.scheduled[0].step.num_tokens
    assert n0 == model.max_chunk(StepFeatures(), 0, 0.03, 32768) and 0 < n0 < 32768
    assert out.predicted_time_s <= 0.03
    s.update_from_output(out, {})
    out = s.schedule()
    n1 = out.scheduled[0].step.num_tokens
    assert n1 == model.max_chunk(StepFeatures(), n0, 0.03, 32768) and n1 < n0  # deeper prefix: smaller chunk


@pytest.mark.parametrize("target", [0.006, 0.0041])
def test_decodes_first_and_prefill_keeps_progressing_past_the_target(target):
    model = CostModel(TRUE)
    s = _sched(model, target=target, min_chunk=32)
    s.cost_model = None  # set-up step: prefill the 40 short prompts at once
    for i in range(40):
        s.add_request(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=50), seed=0)
    out = s.schedule()
    s.update_from_output(out, {x.request_id: [5] for x in out.scheduled if x.num_sample_rows})
    s.cost_model = model
    s.add_request("long", list(range(1, 5000)), SamplingParams(max_tokens=1), seed=0)
    s.add_request("long2", list(range(1, 5000)), SamplingParams(max_tokens=1), seed=0)
    out = s.schedule()
    sizes = {x.request_id: x.step.num_tokens for x in out.scheduled}
    assert all(sizes[f"d{i}"] == 1 for i in range(40))
    base = StepFeatures.of([(1, 3)] * 40)
    fit = model.max_chunk(base, 0, target, 4999)
    if target == 0.006:
        assert fit > 32 and sizes["long"] == fit and out.predicted_time_s <= target
    else:  # decodes alone nearly fill the target: the first prefill still gets min_chunk_tokens
        assert fit < 32 and sizes["long"] == 32
    assert "long2" not in sizes  # nothing left for a second chunk
