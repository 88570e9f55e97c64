"""Shared helpers of the V4.1 tests: a runner over a tiny checkpoint (the generic ModelRunner, which
finds V4.1 in the model registry) and the V4 sequence driver (slot i, a private block range)."""

from __future__ import annotations

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import SeqDriver
from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint
from deepinfer.engine.models.deepseek_v41.tiny_model import TEST_SIZES, write_tiny_v41

__all__ = ["SeqDriver", "TEST_SIZES", "load_runner", "write_tiny_v41"]


def load_runner(model_dir, *, num_blocks=64, num_slots=4, block_size=16, lookahead=6, **kw) -> ModelRunner:
    loaded = load_v41_checkpoint(model_dir)
    return ModelRunner(loaded.config, loaded.tensors, num_blocks=num_blocks, num_slots=num_slots,
                       block_size=block_size, lookahead=lookahead, **kw)
