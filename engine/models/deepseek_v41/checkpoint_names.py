"""Tensor names of an official V4.1 checkpoint and the model's canonical names.

Official names have no ``model.`` prefix: ``embed.weight``, ``norm.weight``, ``head.weight``;
per layer ``layers.L.attn.wq_a.weight`` (+ ``.scale``: the UE8M0 block scale of an FP8 weight),
``layers.L.ffn.experts.E.w1.weight`` (MXFP4), ``layers.L.engram.*``; DSpark stages ``mtp.K.*``
with the same block tensors plus stage extras. Canonical names are V4's module names
(``layers.L.self_attn.q_a_proj.weight``, merged ``layers.L.mlp.experts.gate_up_proj``; V4's
checkpoint_names.py maps the shared ones) with V4.1's indexer, Engram and stage tensors.

The vision tower (``vision.*``, ``aligner.*``, ``image_start|end|newline``) is recognised and
left to vision_weights.py. The backbone routers' image bias (``layers.L.ffn.gate.bias_vl``) is
the text model's (``mlp.gate.bias_vl``) when the config has a vision tower; the DSpark stages'
is recognised and unused (drafts are text).
"""

from __future__ import annotations

import re

from deepinfer.engine.models.deepseek_v4.checkpoint_names import ExpertSlice, is_fp32_param
from deepinfer.engine.models.deepseek_v4.checkpoint_names import to_canonical as v4_canonical
from deepinfer.engine.models.deepseek_v4.checkpoint_names import to_native as v4_native
from deepinfer.engine.models.deepseek_v41.config import V41Config

# official name after "layers.L." (or "mtp.K.") -> canonical name after the same prefix, where
# V4.1 differs from V4 (its indexer lives beside the compressor, not inside it)
_LAYER_NAMES = {
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "attn.indexer.wk.weight": "self_attn.indexer.k_proj.weight",
    "attn.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "engram.embed.weight": "engram.embed",
    "engram.embed.scale": "engram.embed_scale",
    "engram.wkv.weight": "engram.wkv.weight",
    "engram.q_weight": "engram.q_weight",
    "engram.k_weight": "engram.k_weight",
    "ffn.gate.bias_vl": "mlp.gate.bias_vl",
}
_STAGE_NAMES = ("main_proj.weight", "main_norm.weight", "norm.weight", "markov_head.embed.weight",
                "markov_head.head.weight", "confidence_head.proj.weight")
_PREFIX = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_VISION_TOWER = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
_IMAGE_BIAS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.gate\.bias_vl$")
# canonical linears stored as FP8 E4M3 with [32, 32] UE8M0 block scales in the official layout
_FP8 = re.compile(
    r"\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|indexer\.q_b_proj)\.weight$"
    r"|\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$|\.engram\.wkv\.weight$|^mtp\.0\.main_proj\.weight$"
)
_FP32 = re.compile(r"\.engram\.(q_weight|k_weight|embed_scale)$|\.mlp\.gate\.bias_vl$")
ENGRAM_TABLE = re.compile(r"\.engram\.embed$")
TOKEN_MAP = "engram_hash.token_map"


def is_vision_tower(name: str) -> bool:
    """A tensor of the vision tower (vision_weights.py loads it)."""
    return bool(_VISION_TOWER.search(name))


def is_vision(name: str, config: V41Config | None = None) -> bool:
    """A stored tensor the text model leaves alone: the tower's, a DSpark stage's image bias, and
    every image bias of a config without a vision tower."""
    if _VISION_TOWER.search(name):
        return True
    if _IMAGE_BIAS.search(name):
        return name.startswith("mtp.") or config is None or config.vision is None
    return False


def to_canonical(name: str) -> str | ExpertSlice:
    """Canonical name of an official tensor name (no ``model.`` prefix)."""
    m = _PREFIX.match(name)
    if m is None:
        return v4_canonical(name)
    kind, index, rest = m.groups()
    if kind == "mtp" and rest in _STAGE_NAMES:
        return name
    if rest in _LAYER_NAMES:
        return f"{kind}.{index}.{_LAYER_NAMES[rest]}"
    mapped = v4_canonical(f"layers.{index}.{rest}")
    if kind == "layers":
        return mapped
    if isinstance(mapped, ExpertSlice):
        return ExpertSlice(f"mtp.{mapped.target[len('layers.'):]}", mapped.expert, mapped.part)
    return f"mtp.{mapped[len('layers.'):]}"


_OFFICIAL_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}


def to_official(name: str) -> str:
    """Official name of a canonical non-expert tensor (the inverse of ``to_canonical``)."""
    m = _PREFIX.match(name)
    if m is None:
        return v4_native(name)
    kind, index, rest = m.groups()
    if kind == "mtp" and rest in _STAGE_NAMES:
        return name
    if rest in _OFFICIAL_LAYER_NAMES:
        return f"{kind}.{index}.{_OFFICIAL_LAYER_NAMES[rest]}"
    return f"{kind}.{index}." + v4_native(f"layers.{index}.{rest}").split(".", 2)[2]


def official_expert_name(prefix: str, expert: int, part: str) -> str:
    """``layers.L`` / ``mtp.K`` + expert + gate|up|down -> ``....ffn.experts.E.w1|w3|w2.weight``."""
    return f"{prefix}.ffn.experts.{expert}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[part] }.weight"


def is_fp8_linear(name: str) -> bool:
    return bool(_FP8.search(name))


def keeps_fp32(name: str) -> bool:
    """Kept in float32 whatever the compute dtype: mHC weights, sinks, norms, router biases, Engram gates."""
    return is_fp32_param(name) or bool(_FP32.search(name)) or name.endswith(".k_norm.weight")


def canonical_shapes(c: V41Config) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of ``c``'s model (the loader's expectations), in a fixed order."""
    import torch

    from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(c, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
