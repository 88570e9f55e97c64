"""Load the vision tower of an official V4.1 checkpoint (``vision.*``, ``aligner.*``, ``image_*``).

The text loader (loader.py) recognises these tensors and leaves them here. They are stored under
the tower's own parameter names (vision.py), in bfloat16 (or FP8 E4M3 with a ``.scale`` next to
the weight, dequantised with the checkpoint's block); names, shapes and coverage are checked
before anything is read, every failure a one-line ``CheckpointError``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.engine.loader.dequant import QuantFormatError, dequant_fp8
from deepinfer.engine.loader.weights import CheckpointError, weight_files
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.vision import V41VisionTower
from deepinfer.engine.models.deepseek_v41.vision_config import VisionConfig


def vision_config_of(cfg: V41Config) -> VisionConfig | None:
    return None if cfg.vision is None else VisionConfig.from_dict(cfg.vision)


def load_vision_tower(model_dir: str | Path, cfg: V41Config, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", batch_invariant: bool = True) -> V41VisionTower:
    model_dir = Path(model_dir)
    vc = vision_config_of(cfg)
    if vc is None:
        raise CheckpointError(f"{model_dir}/config.json has no vision_config: this checkpoint reads no images")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in V41VisionTower(vc, cfg.hidden_size).state_dict().items()}
    block = tuple((cfg.quantization or {}).get("weight_block_size", (32, 32)))
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            for key in sorted(k for k in keys if names.is_vision_tower(k) and not k.endswith(".scale")):
                if key not in expected:
                    raise CheckpointError(f"unexpected vision tensor {key!r} in {path}: the vision_config describes no "
                                          "such weight")
                t = f.get_tensor(key)
                scale_key = key.removesuffix("weight") + "scale"
                if key.endswith(".weight") and scale_key in keys:
                    try:
                        t = dequant_fp8(t, f.get_tensor(scale_key), block, torch.float32)
                    except QuantFormatError as exc:
                        raise CheckpointError(f"tensor {key!r} in {path}: {exc}") from None
                if tuple(t.shape) != expected[key]:
                    raise CheckpointError(f"vision tensor {key!r} in {path} has shape {tuple(t.shape)}, the "
                                          f"vision_config expects {expected[key]}")
                tensors[key] = t
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} is missing vision tensor {missing[0]!r} ({len(missing)} missing)")
    tower = V41VisionTower(vc, cfg.hidden_size, device=device, dtype=dtype, batch_invariant=batch_invariant)
    own = tower.state_dict()
    with torch.no_grad():
        for key, t in tensors.items():
            own[key].copy_(t)
    return tower.eval()
