"""``EncoderPool``: the gateway's side of the VE pool (runtime/encoder/__init__.py).

``encode(request_id, images, inbox_address)`` places every image of a request on an encoder
with the VE balancer (runtime/balance/ve_balancer.py: largest first, each on the encoder with the
fewest pending image tokens, counting what this request already put there), sends them at once
and returns when every image's embeddings are in the prefill's inbox. Pending tokens are this
pool's own in-flight images per encoder (exact for one gateway; the encoders' ``VeStatus`` says
what they hold from every gateway).

Liveness: every ``probe_interval_s`` each encoder is asked for its ``VeStatus``; after
``missed_probes`` unanswered probes in a row it is down: its images in flight are cancelled and
placed again on the encoders that are up (a retry excludes the encoder it failed on), and it
takes no new images until a probe is answered again. A transport failure of one send does the
same at once. An image the encoder refuses (its own error reply) fails the request: another
encoder would refuse it too. No encoder up: ``EncoderUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.engine.mm.inputs import PreparedImage
from deepinfer.runtime.balance.types import VELoad
from deepinfer.runtime.balance.ve_balancer import VEBalancer
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import ChannelClosed, DeadlineExceeded, RemoteError, TransportError
from deepinfer.transport.protocol import ErrorCode
from deepinfer.transport.protocol.ve import VeEncode, VeEncoded, VeReply, VeStatus, VeStatusRequest

log = logging.getLogger(__name__)


class EncoderUnavailable(RuntimeError):
    """No encoder is up to encode an image (or every one failed it)."""


class ImageRefused(ValueError):
    """An encoder refused an image (its error reply); one line."""


@dataclass(frozen=True, slots=True)
class EncoderRef:
    name: str
    address: str  # its encode RPC (NodeSpec.engine)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one image went at admission, and every up encoder's pending tokens just before."""

    request_id: str
    image_index: int
    encoder: str
    num_tokens: int
    pending_before: dict[str, int]


@dataclass(slots=True)
class _Encoder:
    ref: EncoderRef
    client: RequestClient
    is_up: bool = True
    missed: int = 0
    pending_tokens: int = 0
    num_images: int = 0  # images this pool had it encode (successfully)
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set when it goes down


class EncoderPool:
    def __init__(self, encoders: Sequence[EncoderRef], *, ctx=None, probe_interval_s: float = 0.25,
                 probe_timeout_s: float = 0.5, missed_probes: int = 2, encode_timeout_s: float = 60.0,
                 record_placements: bool = False):
        if not encoders:
            raise ValueError("an encoder pool needs at least one encoder")
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.missed_probes = missed_probes
        self.encode_timeout_s = encode_timeout_s
        self.balancer = VEBalancer()
        self.placements: list[Placement] | None = [] if record_placements else None
        self.num_reencoded = 0  # images placed again after their encoder was lost
        self._encoders = [_Encoder(ref, RequestClient(ref.address, VeReply, ctx=ctx, name=f"ve-{ref.name}"))
                          for ref in encoders]
        self._probe_task: asyncio.Task | None = None

    async def start(self) -> EncoderPool:
        for e in self._encoders:
            await e.client.start()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="ve-pool-probe")
        return self

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for e in self._encoders:
            await e.client.close()

    @property
    def up(self) -> list[str]:
        return [e.ref.name for e in self._encoders if e.is_up]

    def images_by_encoder(self) -> dict[str, int]:
        return {e.ref.name: e.num_images for e in self._encoders}

    async def statuses(self) -> dict[str, VeStatus | None]:
        async def one(e: _Encoder):
            try:
                return await e.client.request(VeStatusRequest(), timeout_s=self.probe_timeout_s)
            except TransportError:
                return None
        return dict(zip((e.ref.name for e in self._encoders), await asyncio.gather(*map(one, self._encoders))))

    async def encode(self, request_id: str, images: Sequence[PreparedImage], inbox_address: str) -> list[VeEncoded]:
        """Every image encoded and pushed to ``inbox_address`` (in image order)."""
        chosen = self._place(request_id, {i: im.num_tokens for i, im in enumerate(images)}, exclude=())
        tasks = [asyncio.create_task(self._encode_one(request_id, i, image, inbox_address, chosen[i]),
                                     name=f"ve-{request_id}-{i}") for i, image in enumerate(images)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def encode_until(self, request_id: str, images: Sequence[PreparedImage], inbox_address: str, *,
                           cut_off: asyncio.Future, deadline: float) -> bool:
        """``encode`` unless ``cut_off`` resolves first (False: it was cut off, the encodes are
        cancelled) or the loop time passes ``deadline`` (``EncoderUnavailable``)."""
        loop = asyncio.get_running_loop()
        encode = asyncio.ensure_future(self.encode(request_id, images, inbox_address))
        try:
            await asyncio.wait([encode, cut_off], timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not encode.done():
                encode.cancel()
                with contextlib.suppress(BaseException):
                    await encode
        if cut_off.done():
            return False
        if encode.cancelled():
            raise EncoderUnavailable(f"{request_id}'s images were not encoded before its deadline")
        encode.result()
        return True

    def _place(self, request_id: str, sizes: dict[int, int], exclude: Sequence[_Encoder]) -> dict[int, _Encoder]:
        """Image index -> encoder for images of ``sizes`` (index -> image tokens)."""
        up = [e for e in self._encoders if e.is_up and e not in exclude]
        if not up:
            raise EncoderUnavailable(f"no vision encoder is up to encode {request_id}'s images "
                                     f"({len(self._encoders)} configured)")
        chosen = {}
        for i in sorted(sizes, key=lambda i: -sizes[i]):  # the balancer's own order: largest first
            before = {e.ref.name: e.pending_tokens for e in up}
            k = self.balancer.assign([sizes[i]], [VELoad(k, e.pending_tokens) for k, e in enumerate(up)]).image2engine[0]
            chosen[i] = up[k]
            up[k].pending_tokens += sizes[i]  # admitted: pending until it is encoded or moved
            if self.placements is not None:
                self.placements.append(Placement(request_id, i, up[k].ref.name, sizes[i], before))
        return chosen

    async def _encode_one(self, request_id: str, index: int, image: PreparedImage, inbox: str,
                          encoder: _Encoder) -> VeEncoded:
        tried: list[_Encoder] = []
        while True:
            try:
                reply = await self._send(encoder, request_id, index, image, inbox)
            except _Lost as lost:
                encoder.pending_tokens -= image.num_tokens
                log.warning("encoder %s lost image %d of %s (%s); encoding it elsewhere", encoder.ref.name, index,
                            request_id, lost)
                self._mark_down(encoder)
                tried.append(encoder)
                self.num_reencoded += 1
                encoder = self._place(request_id, {index: image.num_tokens}, exclude=tried)[index]
                continue
            except BaseException:
                encoder.pending_tokens -= image.num_tokens
                raise
            encoder.pending_tokens -= image.num_tokens
            encoder.num_images += 1
            return reply

    async def _send(self, encoder: _Encoder, request_id: str, index: int, image: PreparedImage,
                    inbox: str) -> VeEncoded:
        if not encoder.is_up:
            raise _Lost("down before the image was sent")
        pixels = image.pixels.detach().contiguous()
        msg = VeEncode(request_id, index, list(image.grid), image.num_tokens, image.content_hash,
                       str(pixels.dtype).removeprefix("torch."), inbox, timeout_s=self.encode_timeout_s)
        send = asyncio.ensure_future(encoder.client.request(
            msg, timeout_s=self.encode_timeout_s, buffers=[pixels.view(torch.uint8).numpy()]))
        lost = asyncio.ensure_future(encoder.lost.wait())
        try:
            await asyncio.wait({send, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                raise _Lost("stopped answering probes")
            try:
                return send.result()
            except RemoteError as exc:
                if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.CLOSED, ErrorCode.DRAINING):
                    raise _Lost(str(exc)) from None
                raise ImageRefused(f"encoder {encoder.ref.name} refused image {index} of {request_id}: {exc}") from None
            except (DeadlineExceeded, ChannelClosed) as exc:
                raise _Lost(str(exc)) from None
        finally:
            for f in (send, lost):
                f.cancel()
                with contextlib.suppress(BaseException):
                    await f

    def _mark_down(self, encoder: _Encoder) -> None:
        if encoder.is_up:
            encoder.is_up = False
            encoder.lost.set()
            log.warning("vision encoder %s is down", encoder.ref.name)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self._encoders))
            await asyncio.sleep(self.probe_interval_s)

    async def _probe(self, encoder: _Encoder) -> None:
        try:
            await encoder.client.request(VeStatusRequest(), timeout_s=self.probe_timeout_s)
        except TransportError:
            encoder.missed += 1
            if encoder.missed >= self.missed_probes:
                self._mark_down(encoder)
            return
        encoder.missed = 0
        if not encoder.is_up:
            encoder.is_up = True
            encoder.lost = asyncio.Event()
            log.info("vision encoder %s is up again", encoder.ref.name)


class _Lost(Exception):
    """The encoder an image was sent to is gone (down, closed, no reply in time)."""
