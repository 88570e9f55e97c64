from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.sched.cost_model import CostModel, StepFeatures
from deepinfer.engine.sched.cost_profile import profile_cost_model
from deepinfer.engine.sched.scheduler import SchedulerConfig

HIDDEN = np.array([2e-3, 3e-5, 5e-6, 4e-10, 1e-9])


class FakeTime:
    """A step timer advanced by the fake runner: each forward 'takes' the hidden quadratic cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class QuadraticRunner:
    def __init__(self, clock: FakeTime, vocab: int):
        self.clock, self.vocab = clock, vocab

    def execute(self, batch):
        f = StepFeatures.of([(s.num_tokens, s.start_pos) for s in batch.steps])
        self.clock.now += float(f.vector() @ HIDDEN)
        return torch.zeros(batch.num_logits, self.vocab)


def make(budget=1024, cost_model=None, target=None):
    clock = FakeTime()
    cfg = EngineCoreConfig(SchedulerConfig(block_size=64, max_num_seqs=32, max_num_batched_tokens=budget,
                                           max_model_len=20000, step_time_target_s=target),
                           num_blocks=2048, vocab_size=32)
    return EngineCore(QuadraticRunner(clock, 32), cfg, cost_model=cost_model, step_timer=clock)


def test_profile_recovers_the_step_cost():
    core = make(cost_model=CostModel())
    model = profile_cost_model(core, prompt_lens=(64, 700, 3000, 9000), decode_batches=(1, 8, 32))
    np.testing.assert_allclose(model.coef, HIDDEN, rtol=1e-3)
    # profile requests are gone and left nothing behind
    assert not core.has_unfinished_requests()
    s = core.scheduler
    assert s.pool.num_cached_blocks == 0 and s.pool.num_free_blocks == s.pool.num_blocks
    core.check_integrity()


def test_profiled_model_then_sizes_chunks():
    core = make(budget=8192, cost_model=CostModel(), target=0.02)
    model = profile_cost_model(core, prompt_lens=(64, 700, 3000), decode_batches=(1, 8))
    from deepinfer.engine.api.sampling_params import SamplingParams

    core.add_request("long", [i % 32 for i in range(15000)], SamplingParams(max_tokens=1))
    plan = core.schedule_step()
    n = plan.batch.steps[0].num_tokens
    assert n == model.max_chunk(StepFeatures(), 0, 0.02, 8192) and n < 8192
    assert plan.sched.predicted_time_s == pytest.approx(float(StepFeatures.of([(n, 0)]).vector() @ HIDDEN), rel=1e-3)


def test_profile_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost_model"):
        profile_cost_model(make())
