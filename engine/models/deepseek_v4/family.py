"""DeepSeek-V4 as a model family of the registry (engine/models/registry.py): config, loader, model, context."""

from __future__ import annotations

from deepinfer.engine.models.deepseek_v4.config import ARCHITECTURES, ModelConfig, is_untyped_v4
from deepinfer.engine.models.registry import ModelFamily


def _load_checkpoint(model_dir, *, dtype, device, progress: bool = True):
    from deepinfer.engine.loader.weights import load_checkpoint

    return load_checkpoint(model_dir, dtype=dtype, device=device, progress=progress, names=_checkpoint_names())


def _checkpoint_names():
    from deepinfer.engine.models.deepseek_v4 import checkpoint_names

    return checkpoint_names


def _build_model(config: ModelConfig, **kwargs):
    from deepinfer.engine.models.deepseek_v4.model import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(config, **kwargs)


def _forward_context():
    from deepinfer.engine.models.deepseek_v4.context import build_context, validate

    return validate, build_context


FAMILY = ModelFamily(
    model_type="deepseek_v4",
    architecture=ARCHITECTURES["deepseek_v4"],
    config_class=ModelConfig,
    load_checkpoint=_load_checkpoint,
    build_model=_build_model,
    forward_context=_forward_context,
    accepts_untyped=is_untyped_v4,
    checkpoint_names=_checkpoint_names,
)
