"""The sending end of the bulk data plane (overview in ``transport.dataplane``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from deepinfer.transport import cma
from deepinfer.transport.buffers import as_send_view
from deepinfer.transport.bulk_plan import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WINDOW_MESSAGES,
    SOCKET_BUFFER_BYTES,
    TransferResult,
    plan_segments,
)
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import ChannelClosed, DeadlineExceeded, OversizedFrame, TransferFailed, TransportError
from deepinfer.transport.protocol import (
    BufferSpec,
    BulkAbort,
    BulkAck,
    BulkBegin,
    BulkChunk,
    BulkFrame,
    BulkReply,
    CmaSource,
    ErrorCode,
)
from deepinfer.transport.security import CurveClientKeys
from deepinfer.transport.sockets import ChannelStats, new_socket

log = logging.getLogger(__name__)


class BulkSender:
    """DEALER side. Concurrent ``send`` calls on one sender interleave safely (per-message ids).

    ``use_cma``: let a same-host receiver pull buffers from our memory over its side channel
    (default: yes for ``ipc://`` on Linux). Without a side channel to connect to we send frames
    (and try the side channel again a second later); if the receiver may not read our memory
    it says so once and we send frames from then on.
    """

    def __init__(self, address: str, *, ctx: zmq.asyncio.Context | None = None, curve: CurveClientKeys | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, window_messages: int = DEFAULT_WINDOW_MESSAGES,
                 default_timeout_s: float = 60.0, use_cma: bool | None = None, name: str = "bulk-sender"):
        if chunk_bytes <= 0 or window_messages <= 0:
            raise ValueError(f"chunk_bytes and window_messages must be positive, got {chunk_bytes}, {window_messages}")
        self.address = address
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.default_timeout_s = default_timeout_s
        self.is_cma = address.startswith("ipc://") and cma.is_supported() if use_cma is None else use_cma
        self.stats = ChannelStats()
        self._window = window_messages
        self._ctx = ctx
        self._curve = curve
        self._codec = Codec(BulkFrame)
        self._reply_codec = Codec(BulkReply)
        self._side: asyncio.StreamWriter | None = None
        self._side_task: asyncio.Task | None = None
        self._side_retry_at = 0.0
        # One side link at a time: concurrent first sends used to open one each, orphaning the
        # earlier link's ack reader (its acks were never read) and letting its end fail and
        # close the newer link's transfers. Each transfer remembers the link it went out on.
        self._side_lock = asyncio.Lock()
        self._tid2side: dict[int, asyncio.StreamWriter] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_tid = 1

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def start(self) -> "BulkSender":
        self._sock = new_socket(self._ctx, zmq.DEALER, curve=self._curve, sndhwm=self._window)
        self._sock.sndbuf = SOCKET_BUFFER_BYTES
        self._sock.connect(self.address)
        if self.is_cma:
            cma.allow_readers()
        self._recv_task = asyncio.create_task(self._recv_acks(), name=f"{self.name}-acks")
        return self

    async def send(self, buffers: Sequence[Any], *, meta: bytes = b"", timeout_s: float | None = None) -> TransferResult:
        """Send ``buffers`` as one transfer; returns once the receiver holds every byte.

        Raises ``DeadlineExceeded`` (no ack in time; the receiver is told to drop it),
        ``OversizedFrame`` (over the receiver's limit), ``TransferFailed`` (receiver gave up).
        """
        if self._sock is None or self._sock.closed:
            raise ChannelClosed(f"{self.name} to {self.address} is not open; call start() first")
        views, specs = [], []
        for buffer in buffers:
            view, spec = as_send_view(buffer)
            views.append(view)
            specs.append(spec)
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                side = await self._side_link()
                ack = await self._transfer(views, specs, meta, side=side)
                if ack.code == ErrorCode.UNAVAILABLE and side is not None:
                    self.is_cma = False
                    self._close_side(side)
                    log.warning("%s: receiver cannot read our memory (%s); sending frames from now on",
                                self.name, ack.message)
                    ack = await self._transfer(views, specs, meta, side=None)
        except TimeoutError:
            raise DeadlineExceeded(f"bulk transfer to {self.address} not acknowledged within {timeout_s:g}s") from None
        if ack.code != ErrorCode.OK:
            error = OversizedFrame if ack.code == ErrorCode.OVERSIZED else TransferFailed
            raise error(f"receiver refused bulk transfer {ack.transfer_id}: {ack.code.name}: {ack.message}", ack.code)
        return TransferResult(transfer_id=ack.transfer_id, num_bytes=ack.num_bytes, seconds=time.perf_counter() - start)

    async def _transfer(self, views: list[memoryview], specs: list[BufferSpec], meta: bytes, *,
                        side: asyncio.StreamWriter | None) -> BulkAck:
        tid = self._next_tid
        self._next_tid += 1
        ack_future = asyncio.get_running_loop().create_future()
        self._pending[tid] = ack_future
        try:
            if side is not None:
                self._tid2side[tid] = side
                source = CmaSource(addresses=[cma.address_of(v) for v in views])
                cma.write_frame(side, self._codec.encode(BulkBegin(tid, specs, self.chunk_bytes, meta, source)))
                self.stats.num_sent += 1
            else:
                plan = plan_segments([spec.num_bytes for spec in specs], self.chunk_bytes)
                for seq, segments in enumerate(plan):
                    if ack_future.done():
                        break  # the receiver refused early (oversized, failed): stop streaming
                    header = BulkBegin(tid, specs, self.chunk_bytes, meta) if seq == 0 else BulkChunk(tid, seq)
                    frames = [self._codec.encode(header)]
                    frames += [views[s.index][s.offset:s.offset + s.length] for s in segments]
                    await self._sock.send_multipart(frames, copy=False)
                    self.stats.num_sent += 1
            return await ack_future
        except asyncio.CancelledError:  # deadline (asyncio.timeout cancels us) or the caller
            self._abort(tid, "sender gave up (deadline or cancelled)", side)
            raise
        finally:
            self._pending.pop(tid, None)
            self._tid2side.pop(tid, None)

    def _abort(self, tid: int, reason: str, side: asyncio.StreamWriter | None) -> None:
        body = self._codec.encode(BulkAbort(tid, reason))
        if side is not None:
            if not side.is_closing():
                cma.write_frame(side, body)
            return
        try:  # best effort: the receiver's idle timeout covers a lost abort
            self._sock.send(body, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def _side_link(self) -> asyncio.StreamWriter | None:
        """The receiver's side channel, connected on first use (None: send frames this time)."""
        if not self.is_cma:
            return None
        if self._side is not None and not self._side.is_closing():
            return self._side
        async with self._side_lock:  # one connect at a time; later callers reuse its link
            if self._side is not None and not self._side.is_closing():
                return self._side
            loop = asyncio.get_running_loop()
            if not self.is_cma or loop.time() < self._side_retry_at:
                return None
            try:
                reader, writer = await asyncio.open_unix_connection(cma.side_path(self.address))
            except OSError:  # no receiver yet, or one that only takes frames
                self._side_retry_at = loop.time() + 1.0
                return None
            self._side = writer
            self._side_task = asyncio.create_task(self._recv_side_acks(reader, writer), name=f"{self.name}-side-acks")
            return writer

    async def _recv_side_acks(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                self._resolve(await cma.read_frame(reader, 1 << 20))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        # the receiver went away: transfers waiting on this link will never be acknowledged
        for tid, side in list(self._tid2side.items()):
            future = self._pending.get(tid)
            if side is writer and future is not None and not future.done():
                future.set_exception(TransferFailed(f"{self.address}: receiver closed the side channel"))
        self._close_side(writer)

    def _close_side(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        if self._side is writer:
            self._side = None

    def _resolve(self, frame: bytes) -> None:
        try:
            ack = self._reply_codec.decode(frame)
        except TransportError as err:
            self.stats.record_drop(err, log, self.name)
            return
        future = self._pending.get(ack.transfer_id)
        if future is None or future.done():
            self.stats.num_late_replies += 1
            return
        future.set_result(ack)

    async def _recv_acks(self) -> None:
        while True:
            try:
                frame = await self._sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._resolve(frame)

    async def close(self) -> None:
        tasks = [t for t in (self._recv_task, self._side_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recv_task = self._side_task = None
        if self._side is not None:
            self._close_side(self._side)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.name} to {self.address} closed"))
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self) -> "BulkSender":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
