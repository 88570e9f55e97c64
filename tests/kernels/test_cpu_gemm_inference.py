"""A model built under ``torch.inference_mode`` (weights are inference tensors, which have no
version counter) computes what the same model built outside it computes.

Regression: the native CPU GEMMs cached packed weight panels only for tensors with a version
counter and re-packed inference tensors per call; ``packed(w).data_ptr()`` passed to native code
then pointed into a temporary freed before the call read it (garbage logits)."""

from __future__ import annotations

import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config


def _logits() -> list[torch.Tensor]:
    cfg = tiny_config()
    runner = ModelRunner(cfg, init_weights(cfg, seed=0), num_blocks=6, num_slots=1, block_size=128,
                         batch_invariant=False)
    prompt = torch.randint(3, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    out = [runner.execute(ForwardBatch([SeqStep(0, 0, list(range(3)), 0, prompt, 1)]))[0].clone()]
    for i in range(3):
        tok = int(out[-1].argmax())
        out.append(runner.execute(ForwardBatch([SeqStep(0, 0, list(range(3)), 200 + i, [tok], 1)]))[0].clone())
    return out


def test_model_built_in_inference_mode_equals_model_built_outside():
    outside = _logits()
    with torch.inference_mode():
        inside = _logits()
    for a, b in zip(outside, inside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
