"""DeepSeek-V4.1 image preprocessing with Pillow: one global view per image, no tiles.

    RGB -> (max_wh_ratio: clamp the width) -> (below min_pixels: scale both sides up)
        -> round each side up to a multiple of patch_size (14)
        -> if the span would pass max_image_tokens: the largest aspect-preserving size that fits
        -> letterbox to that size (Pillow's ImageOps.pad, grey 127, centred)
        -> x / 255, (x - 0.5) / 0.5, bfloat16
        -> patches in row-major grid order, each flattened channel-major (c, y, x): 3 * 14 * 14

A grid of ``nh x nw`` patches becomes ``rows x cols`` aligner cells (``ceil(n / 3)`` each way) and
the prompt span

    [START] + ([IMAGE] * cols + [NEWLINE]) * rows + [END]      rows * (cols + 1) + 2 positions

Every span position carries the image token id; vision.py fills them. The token count is a pure
function of the image's size (``plan_grid``), so a router can price an image before encoding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.mm.inputs import ImageInputError, PreparedImage, pixel_hash
from deepinfer.engine.models.deepseek_v41.vision_config import VisionConfig

PAD_COLOR = (127, 127, 127)
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # the text the chat template writes per image


def num_span_tokens(rows: int, cols: int) -> int:
    return rows * (cols + 1) + 2


@dataclass(frozen=True, slots=True)
class GridPlan:
    height: int  # pixels after resizing (multiples of patch_size)
    width: int
    rows: int  # aligner cells
    cols: int

    @property
    def num_tokens(self) -> int:
        return num_span_tokens(self.rows, self.cols)


def _cells(height: int, width: int, vc: VisionConfig) -> tuple[int, int]:
    p, r = vc.patch_size, vc.downsample_ratio
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit(height: float, width: float, vc: VisionConfig) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose span fits ``max_image_tokens``.

    With rows = aspect * cols the span ``rows * (cols + 1) + 2`` reaches the budget at
    cols = sqrt((budget - 2) / aspect + 1/4) - 1/2; a grid below one cell either way collapses to
    a single column or row."""
    p, budget = vc.patch_size, vc.max_image_tokens
    cell = p * vc.downsample_ratio
    aspect = height / width
    max_cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    max_rows = max_cols * aspect
    if max_cols < 1.0:
        return (budget - 2) // 2 * cell, cell
    if max_rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(max_cols) * cell / width, math.floor(max_rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, vc: VisionConfig) -> GridPlan:
    """Pixel size and cell grid of an image of ``width x height`` (module docstring)."""
    p = vc.patch_size
    w, h = float(width), float(height)
    if vc.max_wh_ratio is not None and w > h * vc.max_wh_ratio:
        w = h * vc.max_wh_ratio
    if 0 < w * h < vc.min_pixels:
        up = math.sqrt(vc.min_pixels / (w * h))
        w, h = float(int(w * up)), float(int(h * up))
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    rows, cols = _cells(best_h, best_w, vc)
    if num_span_tokens(rows, cols) > vc.max_image_tokens:
        best_h, best_w = _fit(h, w, vc)
        rows, cols = _cells(best_h, best_w, vc)
    if num_span_tokens(rows, cols) > vc.max_image_tokens or best_h < p or best_w < p:
        raise ImageInputError(f"an image of {width}x{height} pixels cannot be fitted into {vc.max_image_tokens} "
                              "image tokens")
    return GridPlan(best_h, best_w, rows, cols)


class V41ImageProcessor:
    """PIL image -> ``PreparedImage`` (pixels ``[nh * nw, 3 * p * p]`` bfloat16, grid (nh, nw))."""

    def __init__(self, vision: VisionConfig, image_token_id: int):
        self.vision = vision
        self.image_token_id = image_token_id
        self.placeholder = IMAGE_PLACEHOLDER
        self.max_image_tokens = vision.max_image_tokens

    def plan(self, width: int, height: int) -> GridPlan:
        return plan_grid(width, height, self.vision)

    def prepare(self, image) -> PreparedImage:
        from PIL import ImageOps

        vc, p = self.vision, self.vision.patch_size
        if image.width < 1 or image.height < 1:
            raise ImageInputError(f"an image of {image.width}x{image.height} pixels is empty")
        rgb = image.convert("RGB")
        plan = self.plan(rgb.width, rgb.height)
        if vc.max_wh_ratio is not None and rgb.width >= vc.max_wh_ratio * rgb.height:
            sized = rgb.resize((plan.width, plan.height))  # the clamped width: stretched, not padded
        else:
            sized = ImageOps.pad(rgb, (plan.width, plan.height), color=PAD_COLOR)
        x = torch.from_numpy(np.asarray(sized, dtype=np.float32)).permute(2, 0, 1) / 255
        x = ((x - 0.5) / 0.5).to(torch.bfloat16)
        nh, nw = plan.height // p, plan.width // p
        # [3, nh*p, nw*p] -> [nh, nw, 3, p, p]: patch (i, j) holds rows i*p.. and columns j*p..
        patches = x.reshape(3, nh, p, nw, p).permute(1, 3, 0, 2, 4).reshape(nh * nw, vc.patch_width).contiguous()
        grid = (nh, nw)
        return PreparedImage(patches, grid, plan.num_tokens, pixel_hash(patches, grid))
