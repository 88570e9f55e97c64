"""``VisionEncoder``: a family's image preprocessing and vision tower behind two calls.

    prepare(PIL image) -> PreparedImage          CPU (Pillow), any thread; needs only the config
    encode(PreparedImage) -> [num_tokens, hidden] the device; the tower's weights

A co-located engine holds one with its tower; a disaggregated gateway holds one without
(``prepare`` only: it prices and hashes images, encoder nodes run ``encode``). The model registry
names the family's two builders (``ModelFamily.image_processor``, ``load_vision_tower``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.mm.inputs import ImageInputError, PreparedImage
from deepinfer.engine.models.registry import family
from deepinfer.kernels import ops


class VisionEncoder:
    def __init__(self, processor: Any, tower: Any | None = None):
        self.processor = processor
        self.tower = tower
        self.image_token_id: int = processor.image_token_id
        self.placeholder: str = processor.placeholder
        self.max_image_tokens: int = processor.max_image_tokens

    @classmethod
    def for_config(cls, config: Any) -> VisionEncoder | None:
        """Preprocessing only (no weights); None for a model without a vision tower."""
        build = family(config.model_type).image_processor
        processor = build(config) if build is not None else None
        return None if processor is None else cls(processor)

    @classmethod
    def load(cls, model_dir: str | Path, config: Any, *, dtype: torch.dtype, device: str | torch.device) -> VisionEncoder | None:
        """Preprocessing and the tower's weights; None for a model without a vision tower."""
        encoder = cls.for_config(config)
        if encoder is None:
            return None
        tower = family(config.model_type).load_vision_tower(model_dir, config, dtype=dtype, device=device)
        if torch.device(device).type == "cuda":
            ops.use_gpu()  # an encoder node loads the tower alone: its ops take the Triton kernels too
        return cls(encoder.processor, tower)

    def prepare(self, image: Any) -> PreparedImage:
        """A PIL image -> the tower's input (one-line ``ImageInputError`` for what cannot be used)."""
        try:
            return self.processor.prepare(image)
        except ImageInputError:
            raise
        except (OSError, ValueError) as exc:  # Pillow: truncated or undecodable data
            raise ImageInputError(f"the image could not be read ({exc})") from None

    def encode(self, image: PreparedImage) -> torch.Tensor:
        if self.tower is None:
            raise RuntimeError("this VisionEncoder has no tower (built from the config alone)")
        return self.tower.encode(image)
