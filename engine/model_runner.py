"""One replica's forward: the model, its block cache and SWA arena, ``execute(ForwardBatch)``.

The runner owns device memory only; which blocks and slots a sequence uses is the scheduler's
business (engine/batch.py draws the addressing). ``execute`` returns float32 logits
``[batch.num_logits, vocab]`` in step order (the last ``num_logits`` positions of each step).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer.cache.block_cache import BlockCache
from deepinfer.cache.swa_state import SwaArena
from deepinfer.engine.batch import ForwardBatch
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models import build_model
from deepinfer.engine.models.deepseek_v4.context import build_context, validate


class WeightsError(ValueError):
    """A state dict that does not fit the model; the message names the tensor."""


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, tied: bool = False) -> None:
    """Copy ``state_dict`` into ``model`` (converting dtypes), checking names and shapes first."""
    expected = model.state_dict()
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(expected) - set(state_dict) - optional)
    if missing:
        raise WeightsError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise WeightsError(f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for name, target in expected.items():
        if name not in state_dict:
            continue
        src = state_dict[name]
        if tuple(src.shape) != tuple(target.shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(target.shape)}")
    with torch.no_grad():
        for name, target in expected.items():
            if name in state_dict:
                target.copy_(state_dict[name])


def default_batch_invariant(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        num_blocks: int,
        num_slots: int,
        block_size: int = 128,
        lookahead: int = 6,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_invariant = (
            default_batch_invariant(self.device, dtype) if batch_invariant is None else batch_invariant
        )
        self.model = build_model(config, device=self.device, dtype=dtype)
        load_weights(self.model, state_dict, tied=config.tie_word_embeddings)
        self.model.finalize()
        self.model.eval()
        self.geometry = self.model.geometry(block_size, lookahead)
        self.blocks = BlockCache(
            self.model.paged_specs(), num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=self.device
        )
        self.swa = SwaArena(self.model.ring_specs(lookahead), num_slots=num_slots, dtype=dtype, device=self.device)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_slots(self) -> int:
        return self.swa.num_slots

    @torch.inference_mode()
    def execute_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states ``[num_logits, hidden]`` (the seam for speculative decoding)."""
        validate(batch, self.geometry, self.swa.num_slots)
        ctx = build_context(batch, self.geometry, device=self.device, batch_invariant=self.batch_invariant)
        return self.model(ctx, self.blocks, self.swa)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.execute_hidden(batch)
        return self.model.compute_logits(hidden, self.batch_invariant)
