"""``EncoderService``: the role of an encoder node (``deepinfer node --role encoder``).

    gateway --[VeEncode, pixels]--> encode RPC (NodeSpec.engine)
                                      queue -> one tower thread: VisionEncoder.encode
                                      --bulk [VeEmbeds meta, embeddings]--> prefill's inbox
            <--VeEncoded-----------  (after the inbox holds every byte)

Images are encoded one at a time in arrival order on one thread (the device is the bottleneck;
batching images of different sizes buys little on a ViT this size). ``VeStatus`` reports what is
queued, in image tokens, for the gateways' VE balancer. One bulk sender per inbox address, kept
open. A bad image is that image's error reply (the service serves on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.mm.inputs import PreparedImage
from deepinfer.transport.channels import Incoming, RequestServer
from deepinfer.transport.dataplane import BulkSender
from deepinfer.transport.errors import UnexpectedMessage
from deepinfer.transport.protocol.ve import VeEmbeds, VeEncode, VeEncoded, VeRequest, VeStatus, VeStatusRequest

log = logging.getLogger(__name__)
MAX_PIXEL_BYTES = 64 * 1024 * 1024  # one image's patches (1024 tokens of 3x3 cells of 14x14 RGB: ~11 MB)


class EncoderService:
    def __init__(self, vision: VisionEncoder, address: str):
        if vision.tower is None:
            raise ValueError("an encoder node needs the vision tower's weights")
        self.vision = vision
        self.address = address
        self.node_name = ""
        self.instance_id = 0
        self.num_pending_images = 0
        self.num_pending_image_tokens = 0
        self.num_encoded = 0
        self.server: RequestServer | None = None
        self._tower = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-vision")
        self._senders: dict[str, BulkSender] = {}
        self._ctx = None
        self._meta = msgspec.msgpack.Encoder()

    async def start(self, node) -> None:
        self.node_name, self.instance_id, self._ctx = node.name, node.instance_id, node.ctx
        self.server = RequestServer(self.address, VeRequest, self._handle, ctx=node.ctx, name=f"{node.name}-encode",
                                    max_attachment_bytes=MAX_PIXEL_BYTES, hard_max_bytes=2 * MAX_PIXEL_BYTES)
        self.address = await self.server.start()
        node.metrics.track_channel(f"{node.name}-encode", self.server.stats)
        node.metrics.gauge_function("ve_pending_image_tokens", "Image tokens queued or being encoded",
                                    lambda: self.num_pending_image_tokens)
        log.info("encoder %s serving on %s", node.name, self.address)

    async def drain(self, deadline_s: float) -> None:
        if self.server is not None:
            await self.server.drain(deadline_s)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
        for sender in self._senders.values():
            await sender.close()
        self._senders.clear()
        self._tower.shutdown(wait=True)

    def status(self) -> VeStatus:
        return VeStatus(self.node_name, self.instance_id, self.num_pending_images, self.num_pending_image_tokens,
                        self.num_encoded)

    async def _handle(self, incoming: Incoming):
        msg = incoming.msg
        if isinstance(msg, VeStatusRequest):
            return self.status()
        if isinstance(msg, VeEncode):
            return await self._encode(msg, incoming.buffers)
        raise UnexpectedMessage(f"{type(msg).__name__} is not an encoder request")

    async def _encode(self, msg: VeEncode, buffers) -> VeEncoded:
        image = _prepared(msg, buffers, self.vision)
        self.num_pending_images += 1
        self.num_pending_image_tokens += msg.num_tokens
        try:
            loop = asyncio.get_running_loop()
            start = time.perf_counter()
            embeds = await loop.run_in_executor(self._tower, self.vision.encode, image)
            encode_s = time.perf_counter() - start
        finally:
            self.num_pending_images -= 1
            self.num_pending_image_tokens -= msg.num_tokens
        embeds = embeds.detach().to("cpu").contiguous()
        meta = self._meta.encode(VeEmbeds(msg.request_id, msg.image_index, msg.content_hash, self.node_name))
        sender = await self._sender(msg.inbox_address)
        await sender.send([embeds], meta=meta, timeout_s=msg.timeout_s)
        self.num_encoded += 1
        return VeEncoded(msg.request_id, msg.image_index, msg.num_tokens, encode_s, embeds.numel() * embeds.element_size())

    async def _sender(self, address: str) -> BulkSender:
        sender = self._senders.get(address)
        if sender is None:
            sender = await BulkSender(address, ctx=self._ctx, name=f"{self.node_name}-bulk").start()
            self._senders[address] = sender
        return sender


def _prepared(msg: VeEncode, buffers, vision: VisionEncoder) -> PreparedImage:
    """The attachment as the tower's input; ValueError (one line) when it does not fit the message."""
    if len(buffers) != 1:
        raise ValueError(f"VeEncode carries one attachment (the pixels), got {len(buffers)}")
    dtype = getattr(torch, msg.pixel_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"pixel_dtype {msg.pixel_dtype!r} is not a torch dtype")
    if msg.num_tokens > vision.max_image_tokens or msg.num_tokens < 1:
        raise ValueError(f"an image of {msg.num_tokens} tokens is outside this model's 1..{vision.max_image_tokens}")
    raw = torch.frombuffer(bytearray(buffers[0]), dtype=torch.uint8)
    width = torch.empty((), dtype=dtype).element_size()
    rows = msg.grid[0] * msg.grid[1] if len(msg.grid) == 2 else -1
    if rows < 1 or raw.numel() % (rows * width):
        raise ValueError(f"{raw.numel()} pixel bytes do not fit a grid of {msg.grid} in {msg.pixel_dtype}")
    pixels = raw.view(dtype).view(rows, -1)
    return PreparedImage(pixels, tuple(msg.grid), msg.num_tokens, msg.content_hash)
