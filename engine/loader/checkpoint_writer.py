"""Write canonical tensors as a checkpoint directory, in any layout the loader reads.

Used by ``deepinfer make-tiny-model`` and by tests that need the same weights saved as
transformers writes them (``model.`` prefix, merged experts), as DeepSeek ships them (native
names, one tensor per expert), FP8-quantised (block scales) with MXFP4 experts, or sharded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.engine.loader.dequant import quantize_fp4, quantize_fp8
from deepinfer.engine.loader.weights import INDEX_FILE, SINGLE_FILE
from deepinfer.engine.models.deepseek_v4.checkpoint_names import (
    is_expert_tensor,
    is_fp8_linear,
    native_expert_name,
    to_native,
)
from deepinfer.engine.models.deepseek_v4.config import ModelConfig

FP8_BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    native: bool = False  # DeepSeek's names and config fields, one tensor per expert
    quantize: bool = False  # FP8 E4M3 linears with E8M0 block scales, experts in ``expert_dtype``
    expert_dtype: str = "fp4"  # "fp4" (MXFP4) | "fp8" | "none" (experts unquantised)
    max_shard_bytes: int | None = None  # split into shards + index when set


def save_checkpoint(out_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                    layout: Layout = Layout()) -> ModelConfig:
    """Write config.json and safetensors for ``tensors`` (canonical names); returns the config written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout.quantize:
        cfg = dataclasses.replace(cfg, quantization={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK), "scale_fmt": "ue8m0",
            "expert_dtype": "fp4" if layout.expert_dtype == "fp4" else "fp8",
        })
    config = cfg.to_native_dict() if layout.native else cfg.to_hf_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stored.update(_stored_tensors(name, tensor, layout))
    _write_safetensors(out, stored, layout.max_shard_bytes)
    return cfg


def _stored_tensors(name: str, tensor: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The file entries of one canonical tensor: renamed, split per expert, quantised."""
    tensor = tensor.detach().cpu().contiguous()
    if is_expert_tensor(name):
        return _expert_entries(name, tensor, layout)
    key = to_native(name) if layout.native else _hf_key(name)
    if layout.quantize and is_fp8_linear(name):
        q, scale = quantize_fp8(tensor, FP8_BLOCK)
        return {key: q, _scale_key(key, layout): scale}
    return {key: tensor}


def _expert_entries(name: str, merged: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    layer = int(name.split(".")[1])
    if name.endswith("gate_up_proj"):
        rows = merged.shape[1] // 2
        parts = {"gate": merged[:, :rows], "up": merged[:, rows:]}
    else:
        parts = {"down": merged}
    quant = layout.expert_dtype if layout.quantize else "none"

    def quantized(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if quant == "fp4":
            return quantize_fp4(matrix)
        if quant == "fp8":
            return quantize_fp8(matrix, FP8_BLOCK)
        return matrix.contiguous(), None

    entries: dict[str, torch.Tensor] = {}
    if layout.native:
        for part, stacked in parts.items():
            for expert in range(stacked.shape[0]):
                key = native_expert_name(layer, expert, part)
                q, scale = quantized(stacked[expert])
                entries[key] = q
                if scale is not None:
                    entries[_scale_key(key, layout)] = scale
        return entries
    key = _hf_key(name)
    pairs = [quantized(merged[expert]) for expert in range(merged.shape[0])]
    entries[key] = torch.stack([q for q, _ in pairs])
    if pairs[0][1] is not None:
        entries[key + "_scale_inv"] = torch.stack([s for _, s in pairs])
    return entries


def _hf_key(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def _scale_key(weight_key: str, layout: Layout) -> str:
    base = weight_key.removesuffix(".weight")
    return base + (".scale" if layout.native else ".weight_scale_inv")


def _write_safetensors(out: Path, stored: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(stored, str(out / SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in stored.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata=metadata)
        weight_map.update({key: file_name for key in shard})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
