"""A prompt's images in vLLM's shape, made into the engine's inputs.

    {"prompt": "Describe <｜deepseek_image｜>", "multi_modal_data": {"image": PIL image or [images]}}
    {"prompt_token_ids": [...], "multi_modal_data": {"image": [...]}}

``prompt_images`` reads and checks the ``multi_modal_data`` entry (a PIL image or an already
``PreparedImage``, one per placeholder in the prompt, in order); ``ImagePrompt`` is the result of
preparing them and expanding the placeholders, before or after encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.mm.inputs import ImageInputError, MultiModalInput, PreparedImage
from deepinfer.engine.mm.placement import expand_image_tokens

MODALITIES = ("image",)


def prompt_images(prompt: Any) -> list[Any]:
    """The images of a prompt (empty when it has none); ``ImageInputError`` for a malformed entry."""
    if not isinstance(prompt, Mapping) or prompt.get("multi_modal_data") is None:
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping):
        raise ImageInputError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise ImageInputError(f"multi_modal_data has {unknown[0]!r}; this engine takes {', '.join(MODALITIES)}")
    images = data.get("image")
    if images is None:
        return []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for i, image in enumerate(images):
        if not (isinstance(image, PreparedImage) or _is_pil(image)):
            raise ImageInputError(f"multi_modal_data['image'][{i}] is a {type(image).__name__}; pass PIL images")
    return images


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        return False
    return isinstance(value, Image.Image)


@dataclass(slots=True)
class ImagePrompt:
    """A prompt with its placeholders expanded: ids, one span and prepared image per image."""

    token_ids: list[int]
    spans: list[MultiModalSpan]
    images: list[PreparedImage]

    @classmethod
    def build(cls, vision: VisionEncoder | None, token_ids: Sequence[int], images: Sequence[Any]) -> ImagePrompt:
        """Prepare ``images`` (Pillow, CPU: run it off the event loop) and expand the prompt."""
        if vision is None:
            raise ImageInputError("this model has no vision tower; send text only")
        prepared = [im if isinstance(im, PreparedImage) else vision.prepare(im) for im in images]
        for i, p in enumerate(prepared):
            if p.num_tokens > vision.max_image_tokens:
                raise ImageInputError(f"image {i} spans {p.num_tokens} tokens, over the model's {vision.max_image_tokens}")
        ids, spans = expand_image_tokens(token_ids, vision.image_token_id, prepared, vision.placeholder)
        return cls(ids, spans, prepared)

    @property
    def image_tokens(self) -> list[int]:
        return [p.num_tokens for p in self.images]

    def inputs(self, embeds: Sequence[torch.Tensor | None]) -> list[MultiModalInput]:
        return [MultiModalInput(span, e) for span, e in zip(self.spans, embeds, strict=True)]


async def prepare_prompt_images(vision: VisionEncoder | None, prompt: Any,
                                token_ids: Sequence[int]) -> ImagePrompt | None:
    """A prompt's ``multi_modal_data`` prepared (Pillow on a worker thread) and its placeholders
    expanded, for a caller whose towers are elsewhere (encoder nodes); None without images."""
    images = prompt_images(prompt)
    if not images:
        return None
    return await asyncio.get_running_loop().run_in_executor(None, ImagePrompt.build, vision, token_ids, images)


async def encode_prompt_images(vision: VisionEncoder | None, prompt: Any, token_ids: Sequence[int],
                               device: Executor) -> tuple[list[int], list[MultiModalInput]]:
    """A prompt's ``multi_modal_data`` made into (expanded ids, inputs) by the engine's own tower:
    Pillow on a worker thread, the tower on ``device`` (the engine's device thread, between
    forwards). No images: the ids as given and no inputs."""
    images = prompt_images(prompt)
    if not images:
        return list(token_ids), []
    loop = asyncio.get_running_loop()
    built = await loop.run_in_executor(None, ImagePrompt.build, vision, token_ids, images)
    if vision.tower is None:
        raise ImageInputError("this engine has no vision tower loaded (load_vision=False); its images are encoded "
                              "by encoder nodes")
    embeds = await loop.run_in_executor(device, lambda: [vision.encode(p) for p in built.images])
    return built.token_ids, built.inputs(embeds)
