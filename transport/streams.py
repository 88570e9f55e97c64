"""One-way channels: PUSH/PULL streams and PUB/SUB events (import them from ``channels``).

Frames::

    PUSH -> PULL   [body, attachment, ...]
    PUB  -> SUB    [topic, body]

Receivers decode with one reused typed ``Codec``; a bad frame (undecodable, wrong message type,
wrong number of frames, over the size limit) is logged, counted in ``stats`` and skipped — the
receiver keeps going and ``recv()`` returns the next good message. Nobody can be answered on
these patterns, so there is no error reply.

By default the receiving side binds (a stream's consumer, an event's publisher is the one
address peers know) and the other side connects; pass ``bind=`` to flip it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from deepinfer import envs
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import ChannelClosed, MalformedFrame, OversizedFrame, TransportError
from deepinfer.transport.security import CurveClientKeys, CurveKeyPair, CurveKeys, CurveServerKeys, apply_curve
from deepinfer.transport.sockets import HARD_LIMIT_FACTOR, ChannelStats, bind, drop_silent_peers, new_socket

log = logging.getLogger(__name__)


class _Channel:
    """Socket lifecycle shared by the four one-way endpoints."""

    _kind: int
    _default_bind: bool

    def __init__(self, address: str, *, bind: bool | None, ctx: zmq.asyncio.Context | None,
                 curve: CurveKeys | None, max_frame_bytes: int | None, name: str):
        self.address = address
        self.is_bind = self._default_bind if bind is None else bind
        self.name = name
        self.stats = ChannelStats()
        self.max_frame_bytes = envs.get().max_control_frame_bytes if max_frame_bytes is None else max_frame_bytes
        self._ctx = ctx
        self._curve = curve
        self._sock: zmq.asyncio.Socket | None = None

    async def start(self):
        self._sock = new_socket(self._ctx, self._kind, curve=self._curve,
                                hard_max_bytes=HARD_LIMIT_FACTOR * self.max_frame_bytes)
        self._configure(self._sock)
        if self.is_bind:
            self.address = await bind(self._sock, self.address)
        elif self.address:
            self._sock.connect(self.address)
        return self

    def _configure(self, sock: zmq.asyncio.Socket) -> None:
        pass

    def _open_socket(self) -> zmq.asyncio.Socket:
        if self._sock is None or self._sock.closed:
            raise ChannelClosed(f"{self.name} ({self.address}) is not open; call start() first")
        return self._sock

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class StreamSender(_Channel):
    """PUSH end of a stream (connects by default)."""

    _kind = zmq.PUSH
    _default_bind = False

    def __init__(self, address: str, *, bind: bool | None = None, ctx: zmq.asyncio.Context | None = None,
                 curve: CurveKeys | None = None, name: str = "stream-sender"):
        super().__init__(address, bind=bind, ctx=ctx, curve=curve, max_frame_bytes=None, name=name)
        self._encoder = msgspec.msgpack.Encoder()

    async def send(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        await self._open_socket().send_multipart([self._encoder.encode(msg), *buffers], copy=False)
        self.stats.num_sent += 1


class StreamReceiver(_Channel):
    """PULL end of a stream (binds by default). ``recv()`` returns ``(msg, attachments)``."""

    _kind = zmq.PULL
    _default_bind = True

    def __init__(self, address: str, union: Any, *, bind: bool | None = None,
                 ctx: zmq.asyncio.Context | None = None, curve: CurveKeys | None = None,
                 max_frame_bytes: int | None = None, name: str = "stream-receiver"):
        super().__init__(address, bind=bind, ctx=ctx, curve=curve, max_frame_bytes=max_frame_bytes, name=name)
        self._codec = Codec(union, max_frame_bytes=self.max_frame_bytes)

    async def recv(self) -> tuple[Any, list[memoryview]]:
        sock = self._open_socket()
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.stats.num_received += 1
            try:
                for frame in frames[1:]:
                    if len(frame) > self.max_frame_bytes:
                        raise OversizedFrame(f"attachment of {len(frame)} bytes is over the {self.max_frame_bytes}-byte limit")
                return self._codec.decode(frames[0].buffer), [f.buffer for f in frames[1:]]
            except TransportError as err:
                self.stats.record_drop(err, log, self.name)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[Any, list[memoryview]]:
        try:
            return await self.recv()
        except (ChannelClosed, zmq.ZMQError):
            raise StopAsyncIteration from None


class EventPublisher(_Channel):
    """PUB end of an event channel (binds by default)."""

    _kind = zmq.PUB
    _default_bind = True

    def __init__(self, address: str, *, bind: bool | None = None, ctx: zmq.asyncio.Context | None = None,
                 curve: CurveServerKeys | None = None, name: str = "event-publisher"):
        super().__init__(address, bind=bind, ctx=ctx, curve=curve, max_frame_bytes=None, name=name)
        self._encoder = msgspec.msgpack.Encoder()

    async def publish(self, topic: bytes, msg: Any) -> None:
        # PUB never blocks: a slow or absent subscriber just misses events (heartbeats tolerate that).
        await self._open_socket().send_multipart([topic, self._encoder.encode(msg)])
        self.stats.num_sent += 1


class EventSubscriber(_Channel):
    """SUB end: connects to any number of publishers, each with its own CURVE server key.

    ``recv()`` returns ``(topic, msg)`` for the subscribed topic prefixes.
    """

    _kind = zmq.SUB
    _default_bind = False

    def __init__(self, union: Any, topics: Iterable[bytes] = (b"",), *, ctx: zmq.asyncio.Context | None = None,
                 curve_keypair: CurveKeyPair | None = None, max_frame_bytes: int | None = None,
                 name: str = "event-subscriber"):
        super().__init__("", bind=False, ctx=ctx, curve=None, max_frame_bytes=max_frame_bytes, name=name)
        self._codec = Codec(union, max_frame_bytes=self.max_frame_bytes)
        self._topics = list(topics)
        self._curve_keypair = curve_keypair
        self.publishers: set[str] = set()

    def _configure(self, sock: zmq.asyncio.Socket) -> None:
        drop_silent_peers(sock)  # heartbeats flow again within seconds of a cut link's return
        for topic in self._topics:
            sock.subscribe(topic)

    def connect(self, address: str, server_public: bytes | None = None) -> None:
        """Connect to one more publisher. libzmq copies socket options at connect time, so each
        publisher can have its own CURVE server key."""
        sock = self._open_socket()
        if self._curve_keypair is not None:
            if server_public is None:
                raise ValueError(f"{self.name}: publisher {address} needs its CURVE public key")
            apply_curve(sock, CurveClientKeys(self._curve_keypair, server_public))
        sock.connect(address)
        self.publishers.add(address)

    def disconnect(self, address: str) -> None:
        if address in self.publishers:
            self._open_socket().disconnect(address)
            self.publishers.discard(address)

    async def recv(self) -> tuple[bytes, Any]:
        sock = self._open_socket()
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.stats.num_received += 1
            try:
                if len(frames) != 2:
                    raise MalformedFrame(f"event has {len(frames)} frames; expected [topic, body]")
                return frames[0].bytes, self._codec.decode(frames[1].buffer)
            except TransportError as err:
                self.stats.record_drop(err, log, self.name)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[bytes, Any]:
        try:
            return await self.recv()
        except (ChannelClosed, zmq.ZMQError):
            raise StopAsyncIteration from None
