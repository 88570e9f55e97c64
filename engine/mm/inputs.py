"""What an image is on its way into a forward, and the error a bad one raises.

    PIL image --(family's ImageProcessor.prepare)--> PreparedImage (pixels, grid, num_tokens, hash)
              --(VisionTower.encode)--> embeddings [num_tokens, hidden]
              --> MultiModalInput(span at its prompt positions, embeddings)

``PreparedImage.pixels`` and ``grid`` are the family's layout (V4.1: ``[patches, 3 * 14 * 14]``
bfloat16 in row-major grid order, grid = (patch rows, patch columns)); the engine reads only
``num_tokens`` and ``content_hash``. The hash is of the pixels the tower sees (blake2b), so the
same picture sent twice, in any file format, salts the prefix-cache keys alike
(cache/block_hash.py ``MultiModalSpan``) and another picture never shares its blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.engine.api.protocol import InvalidPromptError


class ImageInputError(InvalidPromptError):
    """An image the engine cannot take (unreadable, too large, placeholders that do not match); one line."""


@dataclass(frozen=True, slots=True)
class PreparedImage:
    pixels: torch.Tensor  # the family's layout (module docstring), on the CPU
    grid: tuple[int, ...]  # the family's shape facts the tower needs
    num_tokens: int  # prompt positions of the image's span, delimiters included
    content_hash: str


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """An image's span of prompt positions and the embeddings that replace the token embeddings
    there (``[span.length, hidden]``). ``embeds`` None: the span's KV is never computed here (a
    decode engine that received it), the span only salts the cache keys."""

    span: MultiModalSpan
    embeds: torch.Tensor | None = None

    @property
    def start(self) -> int:
        return self.span.offset

    @property
    def end(self) -> int:
        return self.span.offset + self.span.length


def pixel_hash(pixels: torch.Tensor, grid: tuple[int, ...]) -> str:
    """Content hash of prepared pixels (dtype, shape and grid included)."""
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-image")
    h.update(repr((str(pixels.dtype), tuple(pixels.shape), grid)).encode())
    h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
