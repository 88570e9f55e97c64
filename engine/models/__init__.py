"""Model definitions, looked up by ``model_type``."""

from __future__ import annotations

from deepinfer.engine.models.deepseek_v4.config import ModelConfig


def build_model(config: ModelConfig, **kwargs):
    """An uninitialised model module for ``config`` (weights come from ``load_state_dict``)."""
    if config.model_type == "deepseek_v4":
        from deepinfer.engine.models.deepseek_v4.model import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM(config, **kwargs)
    if config.model_type == "deepseek_v41":
        from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM(config, **kwargs)
    raise ValueError(f"model_type {config.model_type!r} is not supported; supported: deepseek_v4, deepseek_v41")
