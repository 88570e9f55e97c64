"""Shared helpers of the V4.1 tests: tiny checkpoints written once per session, a runner over the
V4.1 context, and a sequence driver (the V4 one: slot i, a private block range per sequence)."""

from __future__ import annotations

import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import SeqDriver
from deepinfer.engine.models.deepseek_v41 import context as v41_context
from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint
from deepinfer.engine.models.deepseek_v41.tiny_model import TEST_SIZES, write_tiny_v41

__all__ = ["SeqDriver", "TEST_SIZES", "V41Runner", "load_runner", "write_tiny_v41"]


class V41Runner(ModelRunner):
    """ModelRunner with V4.1's batch checks and context (the model registry will pick them)."""

    @torch.inference_mode()
    def execute_hidden(self, batch):
        v41_context.validate(batch, self.geometry, self.swa.num_slots)
        ctx = v41_context.build_context(batch, self.geometry, device=self.device, batch_invariant=self.batch_invariant)
        return self.model(ctx, self.blocks, self.swa)


def load_runner(model_dir, *, num_blocks=64, num_slots=4, block_size=16, lookahead=6, **kw) -> V41Runner:
    loaded = load_v41_checkpoint(model_dir)
    return V41Runner(loaded.config, loaded.tensors, num_blocks=num_blocks, num_slots=num_slots,
                     block_size=block_size, lookahead=lookahead, **kw)
