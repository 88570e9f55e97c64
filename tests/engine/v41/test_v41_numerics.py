"""The official-numerics option of V4.1 (DEEPINFER_V41_NUMERICS=official): the caches hold exactly
the released formats' values, activations round before FP8/FP4 linears; the float path does not."""

from __future__ import annotations

import pytest
import torch

from deepinfer import envs
from deepinfer.engine.loader.config_fields import ModelConfigError
from deepinfer.engine.models.deepseek_v41.numerics import fp4_qdq, fp8_qdq
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")


@pytest.fixture
def numerics(monkeypatch):
    def use(mode: str):
        monkeypatch.setattr(envs, "_snapshot", envs.load({"DEEPINFER_V41_NUMERICS": mode}))
    yield use
    monkeypatch.setattr(envs, "_snapshot", None)


def _run(tiny_dir, ids):
    runner = harness.load_runner(tiny_dir, num_blocks=32, num_slots=2, block_size=16)
    d = harness.SeqDriver(runner, blocks_per_seq=16)
    d.add(0, ids)
    return runner, d, d.prefill([0])[0]


def test_official_numerics_round_the_caches_to_the_released_grids(tiny_dir, numerics):
    ids = torch.randint(3, 480, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    numerics("float")
    float_runner, _, float_logits = _run(tiny_dir, ids)
    numerics("official")
    runner, d, logits = _run(tiny_dir, ids)
    assert runner.model.numerics.official and not float_runner.model.numerics.official
    blocks = d.seqs[0].blocks[: -(-70 // 16)]
    for name, grid in (("compressed", lambda x: fp4_qdq(x, 16, True)), ("indexer_keys", lambda x: fp4_qdq(x, 32, False))):
        for layer in (2, 4, 6):
            rows = runner.blocks.tensor(layer, name)[blocks].flatten(0, 1)
            float_rows = float_runner.blocks.tensor(layer, name)[blocks].flatten(0, 1)
            assert rows.abs().sum() > 0 and torch.equal(grid(rows), rows), (layer, name)  # on the grid
            assert not torch.equal(grid(float_rows), float_rows), (layer, name)  # the float path is not
    window = runner.swa.ring(3, "window")[0]
    assert torch.equal(fp8_qdq(window), window) and not torch.equal(fp8_qdq(float_runner.swa.ring(3, "window")[0]),
                                                                  float_runner.swa.ring(3, "window")[0])
    assert torch.isfinite(logits).all() and not torch.equal(logits, float_logits)
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.3  # noise, not another model


def test_bad_numerics_value_is_a_clear_error(tiny_dir, numerics):
    numerics("fp8")
    with pytest.raises(ModelConfigError, match="DEEPINFER_V41_NUMERICS is 'fp8'; use 'float' or 'official'"):
        harness.load_runner(tiny_dir)
