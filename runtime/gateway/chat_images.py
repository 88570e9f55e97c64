"""Images in chat messages: OpenAI ``image_url`` content parts read into Pillow images, then
prepared and priced by the model's image processor so the prompt the engine gets is expanded.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}   always taken
    {"type": "image_url", "image_url": {"url": "https://..."}}                       only with
                                                                   GatewayConfig.allow_image_urls

Each image is at most ``max_image_bytes`` (encoded; a URL's download stops there) and
``MAX_IMAGE_PIXELS`` once decoded (a decompression bomb is refused before it is expanded). Every
refusal is a 400 naming the content part (``messages[i].content[j].image_url``) with a one-line
reason. Decoding and preparing run on a worker thread: Pillow never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.mm.inputs import ImageInputError
from deepinfer.engine.mm.prompt import ImagePrompt
from deepinfer.runtime.gateway.errors import GatewayError, bad_request
from deepinfer.runtime.gateway.openai_protocol import ChatMessage, ImageUrlPart

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded size; Pillow's own bomb check is a warning below 2x its limit
URL_TIMEOUT_S = 10.0
_DATA_URL = re.compile(r"^data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.S)


@dataclass(frozen=True, slots=True)
class ImageRef:
    """Where an image part sits and what it names."""

    param: str  # messages[i].content[j].image_url
    url: str


def image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    """The image parts of a conversation in prompt order (400 for a part without a url string)."""
    refs = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if not isinstance(part, ImageUrlPart):
                continue
            param = f"messages[{i}].content[{j}].image_url"
            value = part.image_url
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise bad_request(f"{param} must be {{'url': 'data:image/...;base64,...'}}", param)
            refs.append(ImageRef(param, url))
    return refs


async def load_images(refs: Sequence[ImageRef], *, allow_urls: bool, max_bytes: int) -> list[Any]:
    """Pillow images of ``refs`` (400 naming the part for what cannot be used)."""
    out = []
    for ref in refs:
        data = await _image_bytes(ref, allow_urls=allow_urls, max_bytes=max_bytes)
        out.append(await asyncio.to_thread(_decode, ref, data))
    return out


async def expand_chat_prompt(vision: VisionEncoder, token_ids: list[int], images: Sequence[Any],
                             param: str) -> ImagePrompt:
    """The rendered prompt with each image's placeholder expanded to its span (Pillow off the loop)."""
    try:
        return await asyncio.to_thread(ImagePrompt.build, vision, token_ids, images)
    except ImageInputError as exc:
        raise bad_request(str(exc), param) from None


async def _image_bytes(ref: ImageRef, *, allow_urls: bool, max_bytes: int) -> bytes:
    url, param = ref.url, ref.param
    if url.startswith("data:"):
        head = _DATA_URL.match(url)
        if head is None:
            raise bad_request(f"{param} is not a base64 image data URL (data:image/png;base64,...)", param)
        encoded = url[head.end():]
        if len(encoded) > (max_bytes + 2) // 3 * 4 + 4:
            raise _too_large(param, max_bytes)
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{param} holds invalid base64 data", param) from None
        if len(data) > max_bytes:
            raise _too_large(param, max_bytes)
        return data
    if url.startswith(("http://", "https://")):
        if not allow_urls:
            raise bad_request(f"{param}: image URLs are off on this server; send the image inline as a data URL "
                              "(data:image/png;base64,...)", param)
        return await _download(url, param, max_bytes)
    raise bad_request(f"{param} must be a data URL (data:image/...;base64,...) or an http(s) URL", param)


async def _download(url: str, param: str, max_bytes: int) -> bytes:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=URL_TIMEOUT_S)) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise bad_request(f"{param}: fetching the image gave HTTP {resp.status}", param)
                data = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > max_bytes:
                        raise _too_large(param, max_bytes)
                return bytes(data)
    except GatewayError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise bad_request(f"{param}: the image could not be fetched ({type(exc).__name__})", param) from None


def _decode(ref: ImageRef, data: bytes):
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise bad_request(f"{ref.param}: an image of {image.width}x{image.height} pixels is over the "
                                  f"{MAX_IMAGE_PIXELS} pixel limit", ref.param)
            image.load()
    except GatewayError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise bad_request(f"{ref.param}: the image is too large once decoded", ref.param) from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow: not an image / truncated / corrupt
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise bad_request(f"{ref.param} is not a readable image ({reason})", ref.param) from None
    return image


def _too_large(param: str, max_bytes: int) -> GatewayError:
    return bad_request(f"{param}: the image is over the server's {max_bytes}-byte limit per image", param,
                       code="image_too_large")
