"""The serving DSpark drafter (dspark_serving.py) computes what the training drafter (dspark.py) does.

- FeatureCapture's features from the engine's own forward (block cache, SWA slots, chunks) equal
  dense_forward's training features at every position;
- ServingDrafter.propose (the stages on the serving modules) gives DSparkDrafter.draft's tokens
  and confidences for the same block and context;
- the engine's context ring + proposer feed it the injected rows of exactly the accepted positions.
- the calibration file is read (and a bad one refused in one line).
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward
from deepinfer.engine.models.deepseek_v41.dspark import CALIBRATION_FILE, DSparkDrafter
from deepinfer.engine.models.deepseek_v41.dspark_serving import ServingDrafter, load_calibration
from deepinfer.engine.spec.context_ring import ContextRing
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")


@pytest.fixture(scope="module")
def setup(tiny_dir):
    runner = harness.load_runner(tiny_dir, num_blocks=64, num_slots=4, block_size=16)
    return runner, ServingDrafter(runner.model, model_dir=tiny_dir)


def test_captured_features_equal_the_training_features(setup):
    runner, drafter = setup
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(20, 400, (40,), generator=g).tolist()
    # two chunks (24 + 16 tokens) in slot 1: the second reads the first's caches
    table = list(range(8, 12))
    got = []
    for start, end in ((0, 24), (24, 40)):
        runner.execute(ForwardBatch([SeqStep(1, 1, table, start, prompt[start:end], 1)]))
        rows, feats = drafter.take_features()
        assert rows is None and feats.shape == (end - start, 3 * runner.model.config.hidden_size)
        got.append(feats)
    with torch.no_grad():
        want = dense_forward(runner.model, torch.tensor([prompt]), features=True).features[0]
    assert (torch.cat(got) - want).abs().max().item() < 1e-4
    assert drafter.take_features() is None  # taken once


def test_serving_proposal_equals_the_training_drafter(setup):
    runner, drafter = setup
    ref = DSparkDrafter(runner.model)
    ref.temperatures = drafter.drafter.temperatures
    g = torch.Generator().manual_seed(1)
    n, k, c = 6, drafter.block_size, drafter.window
    y = torch.randint(20, 400, (n,), generator=g)
    anchors = torch.randint(c, 300, (n,), generator=g)
    ctx = torch.randn(drafter.num_stages, n, c, drafter.row_width, generator=g)
    valid = torch.rand(n, c, generator=g) > 0.3
    got = drafter.propose(y, anchors, ctx, valid)
    positions = anchors[:, None] + 1 + torch.arange(k)[None]
    with torch.no_grad():
        want = ref.draft(ref.block(ref.block_ids(y), positions, ctx, valid), y)
    assert torch.equal(got.tokens, want.tokens)
    assert (got.confidence - want.confidence).abs().max().item() < 1e-4
    assert got.tokens.shape == (n, k) and bool(((got.confidence > 0) & (got.confidence < 1)).all())


def test_ring_reads_only_positions_in_the_anchor_window():
    ring = ContextRing(num_stages=2, num_slots=3, window=4, width=2)
    ring.claim(1, seq_id=7)
    pos = torch.arange(0, 6)  # positions 0..5 into a 4-row window: 2..5 survive
    rows = torch.arange(12, dtype=torch.float32).view(1, 6, 2).expand(2, 6, 2) * torch.tensor([1.0, -1.0])[:, None, None]
    ring.write(torch.full((4,), 1), pos[2:], rows[:, 2:])
    ctx, valid = ring.read(torch.tensor([1, 1]), torch.tensor([5, 3]))
    tags = ring.tags[1].tolist()
    assert sorted(tags) == [2, 3, 4, 5]
    assert [tags[i] for i in range(4) if valid[0, i]] and sorted(t for i, t in enumerate(tags) if valid[0, i]) == [2, 3, 4, 5]
    assert sorted(t for i, t in enumerate(tags) if valid[1, i]) == [2, 3]  # positions past the anchor are absent
    assert torch.equal(ctx[1, 0, tags.index(4)], torch.tensor([-8.0, -9.0]))
    ring.claim(1, seq_id=8)  # another sequence takes the slot: nothing of the old one is read
    assert not ring.read(torch.tensor([1]), torch.tensor([5]))[1].any()


def test_calibration_file_is_read_and_checked(tmp_path):
    assert load_calibration(tmp_path, 5) is None
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperatures": [1.0, 2.0, 3.0, 4.0, 5.0]}))
    assert load_calibration(tmp_path, 5).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperatures": [1.0, -2.0]}))
    with pytest.raises(ValueError, match="5 positive numbers"):
        load_calibration(tmp_path, 5)
