"""``EmbeddingInbox``: where a prefill engine receives image embeddings from encoder nodes.

A ``BulkReceiver`` on the engine's data plane; each transfer is one image's embeddings with a
``VeEmbeds`` meta. They are held by ``(request_id, image_index)`` until the engine takes them
(``take`` waits, bounded) or ``ttl_s`` passes (a request that never came). A key pushed twice (an
encoder that died after pushing, its image encoded again elsewhere) keeps the last copy: both
are the same tower's output for the same pixels.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import torch

from deepinfer.transport.dataplane import BulkReceiver
from deepinfer.transport.errors import DeadlineExceeded
from deepinfer.transport.protocol.ve import VeEmbeds

log = logging.getLogger(__name__)
Key = tuple[str, int]


class EmbeddingInbox:
    def __init__(self, address: str, *, ctx=None, hidden_size: int | None = None, ttl_s: float = 120.0,
                 name: str = "embedding-inbox"):
        self.hidden_size = hidden_size
        self.ttl_s = ttl_s
        self.num_received = 0
        self.num_dropped = 0  # transfers that were not embeddings of the expected shape
        self._receiver = BulkReceiver(address, ctx=ctx, name=name)
        self._decoder = msgspec.msgpack.Decoder(VeEmbeds)
        self._held: dict[Key, tuple[float, str, torch.Tensor]] = {}
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self._receiver.address

    async def start(self) -> str:
        address = await self._receiver.start()
        self._task = asyncio.create_task(self._recv_loop(), name="embedding-inbox-recv")
        return address

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._receiver.close()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    async def take(self, request_id: str, image_index: int, content_hash: str, timeout_s: float) -> torch.Tensor:
        """The embeddings of that image (removed from the inbox); ``DeadlineExceeded`` when they
        do not arrive in time, ValueError when they are of another picture."""
        key = (request_id, image_index)
        deadline = time.monotonic() + timeout_s
        while key not in self._held:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"image {image_index} of {request_id} did not arrive within {timeout_s:g}s")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                pass
        _, got_hash, embeds = self._held.pop(key)
        if got_hash != content_hash:
            raise ValueError(f"image {image_index} of {request_id}: the embeddings are of image {got_hash}, "
                             f"not {content_hash}")
        return embeds

    def drop(self, request_id: str) -> None:
        """Forget what arrived for ``request_id`` (aborted)."""
        for key in [k for k in self._held if k[0] == request_id]:
            del self._held[key]

    async def _recv_loop(self) -> None:
        while True:
            transfer = await self._receiver.recv()
            try:
                self._accept(transfer)
            except (msgspec.DecodeError, ValueError, IndexError, TypeError) as exc:
                self.num_dropped += 1
                log.warning("embedding inbox: dropped a transfer (%s)", exc)
            finally:
                transfer.release()

    def _accept(self, transfer) -> None:
        meta = self._decoder.decode(transfer.meta)
        if len(transfer.specs) != 1:
            raise ValueError(f"{len(transfer.specs)} buffers, want 1")
        embeds = transfer.view(0)
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
            raise ValueError("the buffer is not a 2-D torch tensor")
        if self.hidden_size is not None and embeds.shape[1] != self.hidden_size:
            raise ValueError(f"embeddings of width {embeds.shape[1]}, the model's is {self.hidden_size}")
        now = time.monotonic()
        self._held[(meta.request_id, meta.image_index)] = (now, meta.content_hash, embeds.clone())
        self.num_received += 1
        for key in [k for k, (t, _, _) in self._held.items() if now - t > self.ttl_s]:
            del self._held[key]
        self._arrived.set()
