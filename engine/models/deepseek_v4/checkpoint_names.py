"""Tensor names and shapes of a V4 checkpoint.

Canonical names are transformers' ``DeepseekV4ForCausalLM`` state_dict names without the
leading ``model.`` (``layers.0.self_attn.q_a_proj.weight``, ``layers.3.mlp.experts.gate_up_proj``
[E, 2I, H] with gate rows first, ``lm_head.weight``). DeepSeek's released checkpoints use their
own names (``layers.0.attn.wq_a.weight``, one ``ffn.experts.E.w1/w2/w3.weight`` per expert,
``embed.weight``, ``head.weight``, ``hc_head_fn``, ...); ``to_canonical`` maps them, and
``to_native`` maps back (for writing test checkpoints). MTP tensors (``mtp.*``) are skipped
for now: the MTP/DSpark loader will claim them through ``is_mtp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deepinfer.engine.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig

# Native name after "layers.L." -> canonical name after "layers.L.".
_NATIVE_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_CANONICAL_LAYER_NAMES = {v: k for k, v in _NATIVE_LAYER_NAMES.items()}
# Other spellings of the same tensors: transformers' save_pretrained writes the attention's
# kv_norm back as ``attn.norm`` (the inverse of its own rename rule).
_NATIVE_LAYER_NAMES["attn.norm.weight"] = "self_attn.kv_norm.weight"
_NATIVE_TOP_NAMES = {
    "embed.weight": "embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
_CANONICAL_TOP_NAMES = {v: k for k, v in _NATIVE_TOP_NAMES.items()}

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# w1 = gate, w3 = up, w2 = down (DeepSeek's naming); transformers' older per-expert spelling too.
_NATIVE_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_HF_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

# Kept in float32 whatever the compute dtype (transformers' _keep_in_fp32_modules_strict):
# mHC mixing weights, sinks, compressor position biases, router bias and every RMSNorm weight.
_FP32_PATTERN = re.compile(
    r"(^|\.)(attn_hc|ffn_hc|hc_head)\.|\.sinks$|\.position_bias$|\.e_score_correction_bias$"
    r"|(^|\.)(q_a_norm|kv_norm|input_layernorm|post_attention_layernorm|norm)\.weight$"
)
# Linears that DeepSeek's release stores as FP8 with block scales (wo_a, the compressors' and
# the indexer's kv/gate projections and its weights_proj stay BF16 there).
_FP8_LINEAR_PATTERN = re.compile(
    r"\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_b_proj|compressor\.indexer\.q_b_proj)\.weight$"
    r"|\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$"
)


@dataclass(frozen=True, slots=True)
class ExpertSlice:
    """One expert's gate, up or down matrix, a slice of a merged canonical expert tensor."""

    target: str  # layers.L.mlp.experts.gate_up_proj | layers.L.mlp.experts.down_proj
    expert: int
    part: str  # "gate" | "up" | "down"


def strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def is_mtp(name: str) -> bool:
    return strip_prefix(name).startswith("mtp.")


def to_canonical(name: str) -> str | ExpertSlice:
    """Canonical name of a checkpoint tensor (either spelling, with or without ``model.``)."""
    name = strip_prefix(name)
    if name in _NATIVE_TOP_NAMES:
        return _NATIVE_TOP_NAMES[name]
    for pattern in (_NATIVE_EXPERT, _HF_EXPERT):
        m = pattern.match(name)
        if m:
            layer, expert, part = int(m.group(1)), int(m.group(2)), _EXPERT_PART[m.group(3)]
            merged = "down_proj" if part == "down" else "gate_up_proj"
            return ExpertSlice(f"layers.{layer}.mlp.experts.{merged}", expert, part)
    m = _LAYER.match(name)
    if m and m.group(2) in _NATIVE_LAYER_NAMES:
        return f"layers.{m.group(1)}.{_NATIVE_LAYER_NAMES[m.group(2)]}"
    return name


def to_native(name: str) -> str:
    """DeepSeek's name of a canonical non-expert tensor."""
    if name in _CANONICAL_TOP_NAMES:
        return _CANONICAL_TOP_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _CANONICAL_LAYER_NAMES:
        return f"layers.{m.group(1)}.{_CANONICAL_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no native name for tensor {name!r}")


def native_expert_name(layer: int, expert: int, part: str) -> str:
    w = {"gate": "w1", "up": "w3", "down": "w2"}[part]
    return f"layers.{layer}.ffn.experts.{expert}.{w}.weight"


def is_fp32_param(name: str) -> bool:
    return bool(_FP32_PATTERN.search(name))


def is_fp8_linear(name: str) -> bool:
    return bool(_FP8_LINEAR_PATTERN.search(name))


def is_expert_tensor(name: str) -> bool:
    return name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of ``cfg``'s model and its shape, in state_dict order."""
    h, v = cfg.hidden_size, cfg.vocab_size
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    q_rank, inter, e = cfg.q_lora_rank, cfg.moe_intermediate_size, cfg.n_routed_experts
    ihd = cfg.index_head_dim
    hc = cfg.hc_mult
    hc_mix = (2 + hc) * hc  # pre weights (hc) + post weights (hc) + residual mixing matrix (hc*hc)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, h)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        a = p + "self_attn."
        shapes[a + "sinks"] = (heads,)
        shapes[a + "q_a_proj.weight"] = (q_rank, h)
        shapes[a + "q_a_norm.weight"] = (q_rank,)
        shapes[a + "q_b_proj.weight"] = (heads * hd, q_rank)
        shapes[a + "kv_proj.weight"] = (hd, h)
        shapes[a + "kv_norm.weight"] = (hd,)
        shapes[a + "o_a_proj.weight"] = (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups)
        shapes[a + "o_b_proj.weight"] = (h, cfg.o_groups * cfg.o_lora_rank)
        if kind != SLIDING:
            ratio = cfg.compress_rates[kind]
            width = 2 * hd if kind == CSA else hd  # CSA windows overlap: two series per token
            c = a + "compressor."
            shapes[c + "position_bias"] = (ratio, width)
            shapes[c + "kv_proj.weight"] = (width, h)
            shapes[c + "gate_proj.weight"] = (width, h)
            shapes[c + "kv_norm.weight"] = (hd,)
            if kind == CSA:
                x = c + "indexer."
                shapes[x + "position_bias"] = (ratio, 2 * ihd)
                shapes[x + "kv_proj.weight"] = (2 * ihd, h)
                shapes[x + "gate_proj.weight"] = (2 * ihd, h)
                shapes[x + "kv_norm.weight"] = (ihd,)
                shapes[x + "q_b_proj.weight"] = (cfg.index_n_heads * ihd, q_rank)
                shapes[x + "scorer.weights_proj.weight"] = (cfg.index_n_heads, h)
            else:
                assert kind == HCA, kind
        m = p + "mlp."
        shapes[m + "gate.weight"] = (e, h)
        if cfg.is_hash_layer(i):
            shapes[m + "gate.tid2eid"] = (v, cfg.num_experts_per_tok)
        else:
            shapes[m + "gate.e_score_correction_bias"] = (e,)
        shapes[m + "experts.gate_up_proj"] = (e, 2 * inter, h)
        shapes[m + "experts.down_proj"] = (e, h, inter)
        shapes[m + "shared_experts.gate_proj.weight"] = (inter, h)
        shapes[m + "shared_experts.up_proj.weight"] = (inter, h)
        shapes[m + "shared_experts.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for hc_name in ("attn_hc", "ffn_hc"):
            shapes[f"{p}{hc_name}.fn"] = (hc_mix, hc * h)
            shapes[f"{p}{hc_name}.base"] = (hc_mix,)
            shapes[f"{p}{hc_name}.scale"] = (3,)
    shapes["norm.weight"] = (h,)
    shapes["hc_head.hc_fn"] = (hc, hc * h)
    shapes["hc_head.hc_base"] = (hc,)
    shapes["hc_head.hc_scale"] = (1,)
    shapes["lm_head.weight"] = (v, h)
    return shapes
