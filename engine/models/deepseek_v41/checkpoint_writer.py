"""Write canonical V4.1 tensors as an official-layout checkpoint directory.

Official names (checkpoint_names.py), nested config.json. ``quantize=True`` stores what DeepSeek
stores in FP8/FP4: the FP8 linears as E4M3 with one UE8M0 scale per [32, 32] block (``X.scale``),
the routed experts as MXFP4 (int8 pairs, one UE8M0 scale per 32 inputs), the Engram tables as
E4M3 rows with one scale per 32 values; everything else as given. ``quantize=False`` stores every
tensor as given, with no quantization_config (e.g. the dequantised weights in float32).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.engine.loader.dequant import quantize_fp4, quantize_fp8
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.config import V41Config

FP8_BLOCK = (32, 32)
TABLE_BLOCK = (1, 32)
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK), "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def save_v41_checkpoint(out_dir: str | Path, cfg: V41Config, tensors: dict[str, torch.Tensor], *,
                        quantize: bool, extra: dict[str, torch.Tensor] | None = None) -> V41Config:
    """config.json + model.safetensors; ``extra``: tensors stored under their own (official)
    names as given (e.g. the vision tower). Returns the config written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, quantization=dict(QUANTIZATION) if quantize else None)
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name == names.TOKEN_MAP or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.endswith(".engram.embed_scale"):
            continue  # written with its table
        t = t.detach().cpu().contiguous()
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            stored.update(_experts(name, t, quantize))
            continue
        key = names.to_official(name)
        block = TABLE_BLOCK if names.ENGRAM_TABLE.search(name) else FP8_BLOCK if names.is_fp8_linear(name) else None
        if quantize and block is not None:
            q, s = quantize_fp8(t, block)
            stored[key], stored[key.removesuffix(".weight") + ".scale"] = q, s
        else:
            stored[key] = t
    for key, t in (extra or {}).items():
        stored[key] = t.detach().cpu().contiguous()
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    return cfg


def _experts(name: str, merged: torch.Tensor, quantize: bool) -> dict[str, torch.Tensor]:
    prefix = name[: -len(".mlp.experts.gate_up_proj")] if name.endswith("gate_up_proj") else \
        name[: -len(".mlp.experts.down_proj")]
    if name.endswith("gate_up_proj"):
        rows = merged.shape[1] // 2
        parts = {"gate": merged[:, :rows], "up": merged[:, rows:]}
    else:
        parts = {"down": merged}
    entries = {}
    for part, stacked in parts.items():
        for expert in range(stacked.shape[0]):
            key = names.official_expert_name(prefix, expert, part)
            if quantize:
                q, s = quantize_fp4(stacked[expert])
                entries[key], entries[key.removesuffix(".weight") + ".scale"] = q, s
            else:
                entries[key] = stacked[expert].contiguous()
    return entries
