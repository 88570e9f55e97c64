"""Typed ``vision_config`` of a DeepSeek-V4.1 checkpoint (the ViT, the aligner and the image budget).

    vision_config: num_hidden_layers 32, hidden_size 1024, num_attention_heads 16,
                   intermediate_size 2816, patch_size 14, rope_theta 10000, downsample_ratio 3,
                   max_image_tokens 1024, min_pixels 295936 (544^2), max_wh_ratio null

``max_image_tokens`` bounds one image's span in the prompt, delimiters included
(``rows * (cols + 1) + 2``); bad values raise ``ModelConfigError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.loader.config_fields import FieldReader, ModelConfigError

MIN_SPAN_TOKENS = 4  # one row of one cell: start, image, newline, end


@dataclass(frozen=True, slots=True)
class VisionConfig:
    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    norm_eps: float = 1e-6  # the ViT's RMSNorms (fixed in DeepSeek's code, not in the config)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_width(self) -> int:
        """Values of one flattened patch: 3 channels x patch_size^2, channel-major."""
        return 3 * self.patch_size * self.patch_size

    @property
    def cell_width(self) -> int:
        """Aligner input of one downsampled cell: ratio^2 ViT rows."""
        return self.downsample_ratio**2 * self.hidden_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VisionConfig:
        r = FieldReader(raw, ModelConfigError, "vision_config.")
        d = cls()
        ratio = r.get("max_wh_ratio")
        cfg = cls(
            num_hidden_layers=r.int("num_hidden_layers", d.num_hidden_layers),
            hidden_size=r.int("hidden_size", d.hidden_size),
            num_attention_heads=r.int("num_attention_heads", d.num_attention_heads),
            intermediate_size=r.int("intermediate_size", d.intermediate_size),
            patch_size=r.int("patch_size", d.patch_size),
            rope_theta=r.float("rope_theta", d.rope_theta, positive=True),
            downsample_ratio=r.int("downsample_ratio", d.downsample_ratio),
            max_image_tokens=r.int("max_image_tokens", d.max_image_tokens, minimum=MIN_SPAN_TOKENS),
            min_pixels=r.int("min_pixels", d.min_pixels, minimum=0),
            max_wh_ratio=None if ratio is None else r.float("max_wh_ratio", 1.0, positive=True),
        )
        if cfg.hidden_size % cfg.num_attention_heads:
            r.fail("num_attention_heads", f"({cfg.num_attention_heads}) must divide hidden_size ({cfg.hidden_size})")
        if cfg.head_dim % 4:
            # the 2D RoPE rotates half of each head, a quarter of it per axis
            r.fail("hidden_size", f"/ num_attention_heads = {cfg.head_dim} must be a multiple of 4 (2D RoPE)")
        return cfg
