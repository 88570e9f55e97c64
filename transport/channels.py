"""Async ZeroMQ channels: request/response (ROUTER/DEALER) here; streams and events in
``transport.streams`` (re-exported below), so ``from deepinfer.transport.channels import ...``
is the one import point.

Request/response frames (the request id is framing, not a message)::

    DEALER -> ROUTER   [request_id u64le, body, attachment, ...]
    ROUTER -> DEALER   [request_id u64le, body, attachment, ...]

``body`` is one message of the channel's request (reply) union; attachments are optional raw
buffers (sent zero-copy, received as memoryviews) for payloads that do not belong in msgpack.

Server: ``RequestServer(address, RequestUnion, handler)``; each request runs as its own task
(``await handler(incoming) -> reply``; return ``WithBuffers(reply, buffers)`` to attach
buffers). A handler that raises is answered with ``ErrorReply(HANDLER_FAILED)`` (a
``TransportError`` with its own code). Bad frames are dropped, counted in ``stats`` and answered
with an ``ErrorReply`` when the sender can be addressed; the server keeps serving.
``drain(deadline_s)`` refuses new requests (``DRAINING``) and waits for in-flight ones.

Client: ``RequestClient(address, ReplyUnion)``; ``await request(msg, timeout_s=...)`` returns
the reply or raises ``DeadlineExceeded`` (the pending entry is removed, a late reply is
dropped) or ``RemoteError`` (the server sent an ``ErrorReply``). Many requests may be in flight
on one client; replies are matched by id.

Both work inside any running asyncio loop (uvloop or not) and close cleanly (linger 0, every
task they started is cancelled and awaited).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import zmq
import zmq.asyncio

from deepinfer import envs
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import (
    ChannelClosed,
    DeadlineExceeded,
    MalformedFrame,
    OversizedFrame,
    RemoteError,
    TransportError,
)
from deepinfer.transport.protocol import ErrorCode, ErrorReply
from deepinfer.transport.security import CurveClientKeys, CurveServerKeys
from deepinfer.transport.sockets import HARD_LIMIT_FACTOR, ChannelStats, bind, drop_silent_peers, new_socket
from deepinfer.transport.streams import EventPublisher, EventSubscriber, StreamReceiver, StreamSender

__all__ = [
    "EventPublisher",
    "EventSubscriber",
    "Incoming",
    "RequestClient",
    "RequestServer",
    "StreamReceiver",
    "StreamSender",
    "WithBuffers",
]

log = logging.getLogger(__name__)

_RID = struct.Struct("<Q")
_NO_RID = _RID.pack(0)  # id 0 is never issued: a reply to it is an error about a bad envelope


@dataclass(slots=True)
class Incoming:
    """One request as the handler sees it."""

    msg: Any
    peer: bytes  # ROUTER identity of the sender
    buffers: list[memoryview]
    body: zmq.Frame | None = None  # the received body frame: libzmq's metadata about the sender

    def peer_property(self, name: str) -> str | None:
        """Connection metadata of the sender: "Peer-Address" (tcp: its IP), "User-Id" (the
        CURVE public key a ZAP handler admitted); None when the transport has none."""
        try:
            return self.body.get(name) if self.body is not None else None
        except zmq.ZMQError:  # not set on this connection (ipc, no ZAP handler, ...)
            return None


class WithBuffers(NamedTuple):
    """A handler's reply with raw buffers attached (sent zero-copy after the body)."""

    msg: Any
    buffers: Sequence[Any]


Handler = Callable[[Incoming], Awaitable[Any]]


def _frame_limits(max_frame_bytes: int | None, max_attachment_bytes: int | None) -> tuple[int, int, int]:
    """(body limit, attachment limit, libzmq hard limit) in bytes."""
    soft = envs.get().max_control_frame_bytes if max_frame_bytes is None else max_frame_bytes
    attachment = soft if max_attachment_bytes is None else max_attachment_bytes
    return soft, attachment, HARD_LIMIT_FACTOR * max(soft, attachment)


class RequestServer:
    """ROUTER side: decode, dispatch each request to ``handler`` concurrently, reply."""

    def __init__(
        self,
        address: str,
        request_union: Any,
        handler: Handler,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: CurveServerKeys | None = None,
        max_frame_bytes: int | None = None,
        max_attachment_bytes: int | None = None,
        hard_max_bytes: int | None = None,
        name: str = "request-server",
    ):
        """``hard_max_bytes`` (default 4x the larger soft limit): frames past it are cut off by
        libzmq before they are buffered; a server taking big attachments sets it near their limit."""
        soft, self._max_attachment_bytes, self._hard_max_bytes = _frame_limits(max_frame_bytes, max_attachment_bytes)
        if hard_max_bytes is not None:
            self._hard_max_bytes = max(hard_max_bytes, soft, self._max_attachment_bytes)
        self.name = name
        self.address = address
        self.stats = ChannelStats()
        self.is_draining = False
        self._codec = Codec(request_union, max_frame_bytes=soft)
        self._reply_encoder = msgspec.msgpack.Encoder()  # any reply Struct the handler returns
        self._handler = handler
        self._ctx = ctx
        self._curve = curve
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    async def start(self) -> str:
        self._sock = new_socket(self._ctx, zmq.ROUTER, curve=self._curve, hard_max_bytes=self._hard_max_bytes)
        self.address = await bind(self._sock, self.address)
        self._recv_task = asyncio.create_task(self._recv_loop(), name=f"{self.name}-recv")
        return self.address

    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            await self._on_frames(frames)
            # a refused request's frames (a big attachment) must not stay alive until the next one
            del frames

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.stats.num_received += 1
        if len(frames) < 3 or len(frames[1]) != _RID.size:
            err = MalformedFrame(f"request has {len(frames)} frames; expected [id, request_id(8 bytes), body, ...]")
            self.stats.record_drop(err, log, self.name)
            rid = frames[1].bytes if len(frames) >= 2 and len(frames[1]) == _RID.size else _NO_RID
            await self._send(frames[0].bytes, rid, err.to_reply())
            return
        peer, rid = frames[0].bytes, frames[1].bytes
        try:
            msg = self._codec.decode(frames[2].buffer)
            oversized = [len(f) for f in frames[3:] if len(f) > self._max_attachment_bytes]
            if oversized:
                raise OversizedFrame(
                    f"attachment of {oversized[0]} bytes is over the {self._max_attachment_bytes}-byte limit"
                )
        except TransportError as err:
            self.stats.record_drop(err, log, self.name)
            await self._send(peer, rid, err.to_reply())
            return
        if self.is_draining:
            await self._send(peer, rid, ErrorReply(ErrorCode.DRAINING, f"{self.name} is draining; retry elsewhere"))
            return
        incoming = Incoming(msg=msg, peer=peer, buffers=[f.buffer for f in frames[3:]], body=frames[2])
        task = asyncio.create_task(self._serve_one(rid, incoming))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_one(self, rid: bytes, incoming: Incoming) -> None:
        buffers: Sequence[Any] = ()
        try:
            reply = await self._handler(incoming)
            if isinstance(reply, WithBuffers):
                reply, buffers = reply
        except asyncio.CancelledError:
            reply = ErrorReply(ErrorCode.CLOSED, f"{self.name} aborted the request while stopping")
        except TransportError as err:
            reply = err.to_reply()
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("%s: handler failed on %s", self.name, type(incoming.msg).__name__)
            reply = ErrorReply(ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}")
        await self._send(incoming.peer, rid, reply, buffers)

    async def _send(self, peer: bytes, rid: bytes, reply: Any, buffers: Sequence[Any] = ()) -> None:
        if self._sock is None or self._sock.closed:
            return
        try:
            await self._sock.send_multipart([peer, rid, self._reply_encoder.encode(reply), *buffers], copy=False)
            self.stats.num_sent += 1
        except zmq.ZMQError as exc:  # peer vanished or socket closing: nothing to answer to
            log.debug("%s: reply not sent: %s", self.name, exc)

    async def drain(self, deadline_s: float) -> int:
        """Refuse new requests; wait up to ``deadline_s`` for in-flight ones, then abort the
        rest (they are answered with CLOSED). Returns the number aborted."""
        self.is_draining = True
        pending = set(self._tasks)
        if not pending:
            return 0
        _, still_running = await asyncio.wait(pending, timeout=deadline_s)
        for task in still_running:
            task.cancel()
        if still_running:
            await asyncio.wait(still_running)
        return len(still_running)

    async def close(self) -> None:
        """Abort in-flight requests, stop receiving and close the socket (linger 0)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        self._recv_task = None
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self) -> "RequestServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class RequestClient:
    """DEALER side: many concurrent requests, each with its own deadline."""

    def __init__(
        self,
        address: str,
        reply_union: Any,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: CurveClientKeys | None = None,
        default_timeout_s: float = 10.0,
        max_frame_bytes: int | None = None,
        max_attachment_bytes: int | None = None,
        name: str = "request-client",
    ):
        soft, _, self._hard_max_bytes = _frame_limits(max_frame_bytes, max_attachment_bytes)
        self.address = address
        self.name = name
        self.default_timeout_s = default_timeout_s
        self.stats = ChannelStats()
        self._codec = Codec(reply_union | ErrorReply, max_frame_bytes=soft)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = ctx
        self._curve = curve
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_rid = 1

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def start(self) -> "RequestClient":
        self._sock = new_socket(self._ctx, zmq.DEALER, curve=self._curve, hard_max_bytes=self._hard_max_bytes)
        drop_silent_peers(self._sock)  # a cut link's return is seen in seconds, not at TCP's back-off
        self._sock.connect(self.address)
        self._recv_task = asyncio.create_task(self._recv_loop(), name=f"{self.name}-recv")
        return self

    async def request(self, msg: Any, *, timeout_s: float | None = None, buffers: Sequence[Any] = ()) -> Any:
        reply, _ = await self.request_with_buffers(msg, timeout_s=timeout_s, buffers=buffers)
        return reply

    async def request_with_buffers(
        self, msg: Any, *, timeout_s: float | None = None, buffers: Sequence[Any] = ()
    ) -> tuple[Any, list[memoryview]]:
        if self._sock is None or self._sock.closed:
            raise ChannelClosed(f"{self.name} to {self.address} is not open; call start() first")
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        rid = self._next_rid
        self._next_rid += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            async with asyncio.timeout(timeout_s):
                await self._sock.send_multipart([_RID.pack(rid), self._encoder.encode(msg), *buffers], copy=False)
                self.stats.num_sent += 1
                reply, attachments = await future
        except TimeoutError:
            raise DeadlineExceeded(
                f"no reply to {type(msg).__name__} from {self.address} within {timeout_s:g}s"
            ) from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise RemoteError.from_reply(reply)
        return reply, attachments

    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self.stats.num_received += 1
            if len(frames) < 2 or len(frames[0]) != _RID.size:
                self.stats.record_drop(MalformedFrame(f"reply has {len(frames)} frames"), log, self.name)
                continue
            (rid,) = _RID.unpack(frames[0].bytes)
            future = self._pending.get(rid)
            if future is None or future.done():
                self.stats.num_late_replies += 1  # its caller already gave up (deadline) or it was never ours
                continue
            try:
                reply = self._codec.decode(frames[1].buffer)
            except TransportError as err:
                self.stats.record_drop(err, log, self.name)
                future.set_exception(err)
                continue
            future.set_result((reply, [f.buffer for f in frames[2:]]))

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.name} to {self.address} closed"))
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self) -> "RequestClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
