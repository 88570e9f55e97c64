"""DeepSeek-V4.1 as a model family of the registry (engine/models/registry.py): config, loader, model, context."""

from __future__ import annotations

from deepinfer.engine.models.deepseek_v41.config import ARCHITECTURE, MODEL_TYPE, V41Config
from deepinfer.engine.models.registry import ModelFamily


def _load_checkpoint(model_dir, *, dtype, device, progress: bool = True):
    from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint

    loaded = load_v41_checkpoint(model_dir, dtype=dtype, device=device)
    return loaded.config, loaded.tensors


def _build_model(config: V41Config, **kwargs):
    from deepinfer import envs
    from deepinfer.engine.loader.config_fields import ModelConfigError
    from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.engine.models.deepseek_v41.numerics import Numerics

    if "numerics" not in kwargs:
        mode = envs.get().v41_numerics
        if mode not in ("float", "official"):
            raise ModelConfigError(f"DEEPINFER_V41_NUMERICS is {mode!r}; use 'float' or 'official'")
        kwargs["numerics"] = Numerics(official=mode == "official")
    return DeepseekV41ForCausalLM(config, **kwargs)


def _forward_context():
    from deepinfer.engine.models.deepseek_v41.context import build_context, validate

    return validate, build_context


def _image_processor(config: V41Config):
    from deepinfer.engine.models.deepseek_v41.image_processor import V41ImageProcessor
    from deepinfer.engine.models.deepseek_v41.vision_weights import vision_config_of

    vision = vision_config_of(config)
    return None if vision is None else V41ImageProcessor(vision, config.image_token_id)


def _load_vision_tower(model_dir, config: V41Config, *, dtype, device):
    from deepinfer.engine.models.deepseek_v41.vision_weights import load_vision_tower

    return load_vision_tower(model_dir, config, dtype=dtype, device=device)


def _build_drafter(model, *, model_dir=None):
    from deepinfer.engine.models.deepseek_v41.dspark_serving import ServingDrafter

    return ServingDrafter(model, model_dir=model_dir)


FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    config_class=V41Config,
    load_checkpoint=_load_checkpoint,
    build_model=_build_model,
    forward_context=_forward_context,
    image_processor=_image_processor,
    load_vision_tower=_load_vision_tower,
    build_drafter=_build_drafter,
)
