"""Typed model configuration for the DeepSeek-V4 family.

Field names follow transformers' ``DeepseekV4Config``. ``ModelConfig.from_dict`` reads three
spellings of the same facts:

- transformers' names (``layer_types``, ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor``, nested ``rope_parameters`` = {"main": ..., "compress": ...});
- the names in DeepSeek's released ``config.json`` (``compress_ratios`` per layer 0/4/128,
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` = YaRN of the compressed layers,
  ``expert_dtype``);
- the field names of DeepSeek's reference inference code (``dim``, ``n_layers``, ``n_heads``,
  ``moe_inter_dim``, ``n_activated_experts``, ``rope_factor``/``original_seq_len``, ...).

Layer kinds are stored as ``layer_types`` (one of SLIDING/CSA/HCA per layer) plus one
compression rate per kind. ``to_hf_dict`` writes transformers' spelling; ``to_native_dict``
writes DeepSeek's released spelling. Bad input raises ``ModelConfigError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.engine.loader.config_fields import FieldReader, ModelConfigError, read_config_json
from deepinfer.engine.loader.quant_config import parse_quantization
from deepinfer.engine.models.deepseek_v4.layer_kinds import (
    CSA,
    HASH_MOE,
    HCA,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    MOE,
    SLIDING,
    parse_layer_kinds,
    parse_mlp_kinds,
)
from deepinfer.engine.models.deepseek_v4.rope_config import RopeConfig, parse_rope

__all__ = [
    "CSA", "HASH_MOE", "HCA", "LAYER_TYPES", "MLP_LAYER_TYPES", "MOE", "SLIDING",
    "ModelConfig", "ModelConfigError", "RopeConfig", "SUPPORTED_MODEL_TYPES",
]

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
ARCHITECTURES = {"deepseek_v4": "DeepseekV4ForCausalLM"}

# DeepSeek reference-inference field name -> our field name.
NATIVE_FIELD_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_hash_layers": "num_hash_layers",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    rope_main: RopeConfig = RopeConfig(theta=10000.0)
    rope_compress: RopeConfig = RopeConfig(theta=160000.0)
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    # Normalised quantization_config (quant_method "fp8", fmt, weight_block_size, scale_fmt
    # "ue8m0"|"float", expert_dtype "fp8"|"fp4", activation_scheme), or None for plain weights.
    quantization: dict[str, Any] | None = None
    # dtype the checkpoint's floating weights are stored in ("bfloat16", "float32", ...), if known.
    checkpoint_dtype: str | None = None

    # ---- derived -------------------------------------------------------------------
    def compress_ratio(self, layer: int) -> int:
        """0 for a window-only layer, else the layer's compression ratio."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(self.compress_ratio(i) for i in range(self.num_hidden_layers))

    def is_hash_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == HASH_MOE

    @property
    def num_hash_layers(self) -> int:
        return sum(1 for t in self.mlp_layer_types if t == HASH_MOE)

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``."""
        return cls.from_dict(read_config_json(model_dir))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        if not isinstance(raw, Mapping):
            raise ModelConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        d = dict(raw)
        for native, ours in NATIVE_FIELD_NAMES.items():
            if native in d:
                d.setdefault(ours, d[native])
        model_type = d.get("model_type")
        if model_type is None and is_untyped_v4(raw):
            model_type = "deepseek_v4"  # DeepSeek's inference configs carry no model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            shown = "no model_type" if model_type is None else f"model_type {model_type!r}"
            raise ModelConfigError(f"unsupported {shown} in config; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        r = FieldReader(d, ModelConfigError)
        defaults = cls()

        hidden = r.int("hidden_size", defaults.hidden_size)
        num_layers = r.int("num_hidden_layers", defaults.num_hidden_layers)
        num_heads = r.int("num_attention_heads", defaults.num_attention_heads)
        if r.int("num_key_value_heads", 1) != 1:
            raise ModelConfigError("config field 'num_key_value_heads' must be 1 (V4 shares one K=V head)")
        head_dim = _head_dim(r, defaults.head_dim)
        rope_dim = _rope_head_dim(r, head_dim)
        compress_rates, layer_types = parse_layer_kinds(r, num_layers)
        mlp_layer_types = parse_mlp_kinds(r, num_layers)
        vocab = r.int("vocab_size", defaults.vocab_size)
        max_pos = r.int("max_position_embeddings", _native_max_positions(r) or defaults.max_position_embeddings)
        rope_main, rope_compress = parse_rope(r, max_pos)

        cfg = cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=r.int("q_lora_rank", defaults.q_lora_rank),
            o_groups=r.int("o_groups", defaults.o_groups),
            o_lora_rank=r.int("o_lora_rank", defaults.o_lora_rank),
            sliding_window=r.int("sliding_window", defaults.sliding_window),
            layer_types=layer_types,
            compress_rates=compress_rates,
            index_n_heads=r.int("index_n_heads", defaults.index_n_heads),
            index_head_dim=r.int("index_head_dim", defaults.index_head_dim),
            index_topk=r.int("index_topk", defaults.index_topk),
            hc_mult=r.int("hc_mult", defaults.hc_mult),
            hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", defaults.hc_sinkhorn_iters),
            hc_eps=r.float("hc_eps", defaults.hc_eps, positive=True),
            mlp_layer_types=mlp_layer_types,
            n_routed_experts=r.int("n_routed_experts", defaults.n_routed_experts),
            n_shared_experts=r.int("n_shared_experts", defaults.n_shared_experts),
            num_experts_per_tok=r.int("num_experts_per_tok", defaults.num_experts_per_tok),
            moe_intermediate_size=r.int("moe_intermediate_size", defaults.moe_intermediate_size),
            scoring_func=r.choice("scoring_func", defaults.scoring_func, SCORING_FUNCS),
            norm_topk_prob=r.bool("norm_topk_prob", defaults.norm_topk_prob),
            routed_scaling_factor=r.float("routed_scaling_factor", defaults.routed_scaling_factor, positive=True),
            swiglu_limit=r.float("swiglu_limit", defaults.swiglu_limit),
            rms_norm_eps=r.float("rms_norm_eps", defaults.rms_norm_eps, positive=True),
            max_position_embeddings=max_pos,
            rope_main=rope_main,
            rope_compress=rope_compress,
            num_nextn_predict_layers=r.int("num_nextn_predict_layers", defaults.num_nextn_predict_layers, minimum=0),
            tie_word_embeddings=r.bool("tie_word_embeddings", defaults.tie_word_embeddings),
            bos_token_id=r.optional_int("bos_token_id", defaults.bos_token_id),
            eos_token_id=r.int_tuple("eos_token_id", defaults.eos_token_id),
            pad_token_id=r.optional_int("pad_token_id", defaults.pad_token_id),
            quantization=parse_quantization(r),
            checkpoint_dtype=_checkpoint_dtype(r),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks; raises ModelConfigError naming the first bad field."""

        def fail(name: str, why: str) -> None:
            raise ModelConfigError(f"config field {name!r} {why}")

        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail("o_groups", f"({self.o_groups}) must divide num_attention_heads * head_dim "
                 f"({self.num_attention_heads * self.head_dim})")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            fail("qk_rope_head_dim", f"({self.qk_rope_head_dim}) must be even and in (0, head_dim={self.head_dim}]")
        if self.qk_rope_head_dim > self.index_head_dim and CSA in self.layer_types:
            fail("index_head_dim", f"({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds n_routed_experts "
                 f"({self.n_routed_experts})")
        if self.n_shared_experts != 1:
            fail("n_shared_experts", f"must be 1 (V4 has one shared expert), got {self.n_shared_experts}")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            fail("mlp_layer_types", f"has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers")
        for token_name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, token_name)
            if value is not None and not 0 <= value < self.vocab_size:
                fail(token_name, f"({value}) is outside the vocabulary [0, {self.vocab_size})")
        for value in self.eos_token_id:
            if not 0 <= value < self.vocab_size:
                fail("eos_token_id", f"({value}) is outside the vocabulary [0, {self.vocab_size})")

    # ---- writing (config_dicts.py) ----------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in transformers' spelling (loads with ``DeepseekV4Config``)."""
        from deepinfer.engine.models.deepseek_v4.config_dicts import to_hf_dict

        return to_hf_dict(self)

    def to_native_dict(self) -> dict[str, Any]:
        """config.json in the spelling of DeepSeek's released checkpoints (``compress_ratios``,
        ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``, ``expert_dtype``)."""
        from deepinfer.engine.models.deepseek_v4.config_dicts import to_native_dict

        return to_native_dict(self)


def is_untyped_v4(raw: Mapping[str, Any]) -> bool:
    """A config.json without model_type that is V4's: DeepSeek's inference spelling or native compress_ratios."""
    return any(name in raw for name in NATIVE_FIELD_NAMES) or "compress_ratios" in raw


# ---- field helpers ------------------------------------------------------------------
def _head_dim(r: FieldReader, default: int) -> int:
    if r.has("head_dim"):
        head_dim = r.int("head_dim", default)
    elif r.has("qk_nope_head_dim") and r.has("qk_rope_head_dim"):
        head_dim = r.int("qk_nope_head_dim", 0, minimum=0) + r.int("qk_rope_head_dim", 0)
    else:
        head_dim = default
    if r.has("v_head_dim") and r.int("v_head_dim", head_dim) != head_dim:
        raise ModelConfigError(f"config field 'v_head_dim' must equal head_dim ({head_dim}): K and V share one head")
    return head_dim


def _rope_head_dim(r: FieldReader, head_dim: int) -> int:
    if r.get("partial_rotary_factor") is not None:
        factor = r.float("partial_rotary_factor", 0.125, positive=True)
        rope_dim = head_dim * factor
        if abs(rope_dim - round(rope_dim)) > 1e-6:
            raise ModelConfigError(f"config field 'partial_rotary_factor' ({factor}) times head_dim ({head_dim}) "
                                   "is not a whole number of channels")
        return int(round(rope_dim))
    if r.has("qk_rope_head_dim"):
        return r.int("qk_rope_head_dim", 64)
    return int(head_dim * 64 / 512)  # V4's default ratio, as transformers does


def _native_max_positions(r: FieldReader) -> int | None:
    """DeepSeek's inference config implies the context length through its YaRN fields."""
    original = r.get("original_seq_len")
    factor = r.get("rope_factor")
    if isinstance(original, int) and original > 0 and isinstance(factor, (int, float)) and factor > 0:
        return int(original * factor)
    return None


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}


def _checkpoint_dtype(r: FieldReader) -> str | None:
    for name in ("dtype", "torch_dtype"):
        value = r.get(name)
        if isinstance(value, str):
            # DeepSeek's inference "dtype": "fp8" means FP8 weights computed in bfloat16.
            return _DTYPE_NAMES.get(value, value)
    return None
