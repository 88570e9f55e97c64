"""The serving drafter's fused context rows and Markov chain equal the training drafter's.

``ServingDrafter.context_rows`` runs every stage's kv_proj as one GEMM on the serving kernels, and
``propose`` draws the Markov chain with the confidence head split into its hidden and embedding
parts; both must give ``DSparkDrafter``'s numbers (dspark.py: ``context_kv(inject(.))`` and
``draft``) on the trained tiny checkpoint, for any number of rows and any positions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import BUILTIN_DIR, builtin_checkpoint
from deepinfer.engine.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.engine.models.deepseek_v41.dspark_serving import ServingDrafter
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")

pytestmark = pytest.mark.skipif(builtin_checkpoint() is None, reason="the trained tiny checkpoint is not in this tree")


@pytest.fixture(scope="module")
def drafters():
    runner = harness.load_runner(BUILTIN_DIR, num_blocks=8, num_slots=2, block_size=16)
    serving = ServingDrafter(runner.model, model_dir=BUILTIN_DIR)
    ref = DSparkDrafter(runner.model)
    ref.temperatures = serving.drafter.temperatures
    return serving, ref


@pytest.mark.timeout(120)
@settings(max_examples=12, deadline=None)
@given(num_rows=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_context_rows_equal_the_training_drafter(drafters, num_rows, seed):
    serving, ref = drafters
    g = torch.Generator().manual_seed(seed)
    width = len(serving.config.dspark_target_layer_ids) * serving.config.hidden_size
    features = torch.randn(num_rows, width, generator=g) * 3
    positions = torch.randint(0, 4000, (num_rows,), generator=g)
    got = serving.context_rows(features, positions)
    with torch.no_grad():
        want = ref.context_kv(ref.inject(features), positions)
    assert got.shape == want.shape == (serving.num_stages, num_rows, serving.row_width)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.timeout(120)
@settings(max_examples=8, deadline=None)
@given(num_requests=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_proposal_equals_the_training_drafter(drafters, num_requests, seed):
    serving, ref = drafters
    g = torch.Generator().manual_seed(seed)
    n, k, c = num_requests, serving.block_size, serving.window
    y = torch.randint(20, 4000, (n,), generator=g)
    anchors = torch.randint(0, 400, (n,), generator=g)
    ctx = torch.randn(serving.num_stages, n, c, serving.row_width, generator=g)
    valid = torch.rand(n, c, generator=g) > 0.2
    got = serving.propose(y, anchors, ctx, valid)
    positions = anchors[:, None] + 1 + torch.arange(k)[None]
    with torch.no_grad():
        want = ref.draft(ref.block(ref.block_ids(y), positions, ctx, valid), y)
    assert torch.equal(got.tokens, want.tokens)
    assert (got.logits - want.logits).abs().max().item() < 1e-4
    assert (got.confidence - want.confidence).abs().max().item() < 1e-5
