"""V4's config.json in the two spellings ModelConfig writes: transformers' and DeepSeek's released one."""

from __future__ import annotations

from typing import Any

from deepinfer.engine.loader.config_fields import ModelConfigError
from deepinfer.engine.models.deepseek_v4.config import ARCHITECTURES, ModelConfig
from deepinfer.engine.models.deepseek_v4.layer_kinds import CSA, HASH_MOE, HCA, MOE, NATIVE_CSA_RATIO
from deepinfer.engine.models.deepseek_v4.rope_config import RopeConfig


def to_hf_dict(self: ModelConfig) -> dict[str, Any]:
    """config.json in transformers' spelling (loads with ``DeepseekV4Config``)."""
    d = _common_dict(self)
    d.update(
        layer_types=list(self.layer_types),
        compress_rates={CSA: self.compress_rates[CSA], HCA: self.compress_rates[HCA]},
        mlp_layer_types=list(self.mlp_layer_types),
        partial_rotary_factor=self.partial_rotary_factor,
        rope_parameters={
            "main": _rope_to_dict(self.rope_main, self.partial_rotary_factor),
            "compress": _rope_to_dict(self.rope_compress, self.partial_rotary_factor),
        },
    )
    if self.quantization is not None:
        d["quantization_config"] = dict(self.quantization)
    return d

def to_native_dict(self: ModelConfig) -> dict[str, Any]:
    """config.json in the spelling of DeepSeek's released checkpoints (``compress_ratios``,
    ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``, ``expert_dtype``)."""
    if self.compress_rates[CSA] != NATIVE_CSA_RATIO and CSA in self.layer_types:
        raise ModelConfigError(f"config field 'compress_rates' CSA rate {self.compress_rates[CSA]} cannot be "
                               f"written as native compress_ratios (CSA is ratio {NATIVE_CSA_RATIO} there)")
    if self.compress_rates[HCA] == NATIVE_CSA_RATIO and HCA in self.layer_types:
        raise ModelConfigError("config field 'compress_rates' HCA rate 4 would read back as CSA in native form")
    num_hash = self.num_hash_layers
    if tuple(self.mlp_layer_types) != (HASH_MOE,) * num_hash + (MOE,) * (self.num_hidden_layers - num_hash):
        raise ModelConfigError("config field 'mlp_layer_types' must be hash layers first to be written as "
                               "native num_hash_layers")
    if self.rope_main.rope_type != "default":
        raise ModelConfigError("config field 'rope_parameters.main' must be plain RoPE to be written in native form")
    rc = self.rope_compress
    if rc.rope_type == "yarn" and (rc.attention_factor != 1.0 or not rc.truncate):
        raise ModelConfigError("config field 'rope_parameters.compress' has YaRN settings (attention_factor, "
                               "truncate) that native rope_scaling cannot express")
    d = _common_dict(self)
    d.update(
        compress_ratios=list(self.compress_ratios),
        num_hash_layers=num_hash,
        qk_rope_head_dim=self.qk_rope_head_dim,
        topk_method="noaux_tc",
    )
    if rc.rope_type == "yarn":
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": rc.factor,
            "original_max_position_embeddings": rc.original_max_position_embeddings,
            "beta_fast": rc.beta_fast,
            "beta_slow": rc.beta_slow,
        }
    if self.quantization is not None:
        quant = dict(self.quantization)
        d["expert_dtype"] = quant.pop("expert_dtype", "fp8")
        d["quantization_config"] = quant
    return d

def _common_dict(self: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": self.head_dim,
        "q_lora_rank": self.q_lora_rank,
        "o_groups": self.o_groups,
        "o_lora_rank": self.o_lora_rank,
        "sliding_window": self.sliding_window,
        "index_n_heads": self.index_n_heads,
        "index_head_dim": self.index_head_dim,
        "index_topk": self.index_topk,
        "hc_mult": self.hc_mult,
        "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
        "hc_eps": self.hc_eps,
        "n_routed_experts": self.n_routed_experts,
        "n_shared_experts": self.n_shared_experts,
        "num_experts_per_tok": self.num_experts_per_tok,
        "moe_intermediate_size": self.moe_intermediate_size,
        "scoring_func": self.scoring_func,
        "norm_topk_prob": self.norm_topk_prob,
        "routed_scaling_factor": self.routed_scaling_factor,
        "swiglu_limit": self.swiglu_limit,
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "rope_theta": self.rope_main.theta,
        "compress_rope_theta": self.rope_compress.theta,
        "num_nextn_predict_layers": self.num_nextn_predict_layers,
        "tie_word_embeddings": self.tie_word_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id),
        "pad_token_id": self.pad_token_id,
    }
    if self.checkpoint_dtype is not None:
        d["dtype"] = self.checkpoint_dtype
    return d


def _rope_to_dict(rope: RopeConfig, partial_rotary_factor: float) -> dict[str, Any]:
    d: dict[str, Any] = {
        "rope_type": rope.rope_type,
        "rope_theta": rope.theta,
        "partial_rotary_factor": partial_rotary_factor,
    }
    if rope.rope_type == "yarn":
        d.update(
            factor=rope.factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            attention_factor=rope.attention_factor,
        )
        if not rope.truncate:
            d["truncate"] = False
    return d
