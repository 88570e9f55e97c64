"""The receiving end of the bulk data plane (overview in ``transport.dataplane``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from deepinfer import envs
from deepinfer.transport import cma
from deepinfer.transport.buffers import BufferPool
from deepinfer.transport.bulk_plan import (
    DEFAULT_WINDOW_MESSAGES,
    SOCKET_BUFFER_BYTES,
    Allocator,
    BulkTransfer,
    Segment,
    plan_segments,
)
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import MalformedFrame, OversizedFrame, TransferFailed, TransportError
from deepinfer.transport.protocol import (
    BulkAbort,
    BulkAck,
    BulkBegin,
    BulkChunk,
    BulkFrame,
    BulkReply,
    CmaSource,
    ErrorCode,
)
from deepinfer.transport.security import CurveServerKeys
from deepinfer.transport.sockets import ChannelStats, bind, new_socket

log = logging.getLogger(__name__)

Key = tuple[bytes, int]  # (sender identity, transfer id)

# Pulls run on the loop thread in pieces of this size (well under a millisecond each), yielding
# between pieces: cheaper than a worker thread hop, and the loop never stalls for long.
_PULL_PIECE_BYTES = 2 << 20


@dataclass(slots=True)
class _Inflight:
    begin: BulkBegin
    buffers: list[Any]
    dests: list[np.ndarray]  # writable uint8 views of ``buffers``
    plan: list[list[Segment]]
    next_seq: int = 0
    last_active: float = field(default_factory=time.monotonic)
    is_pulling: bool = False  # a cross-memory pull is copying into the buffers right now
    is_aborted: bool = False


class BulkReceiver:
    """ROUTER side: reassembles transfers from any number of senders into allocated buffers.

    ``allocate(specs) -> buffers`` (one writable buffer of at least ``spec.num_bytes`` per spec)
    and ``release(buffers)`` default to ``pool`` when given, else plain ``np.empty``.
    Completed transfers come out of ``recv()`` (or ``async for``) in completion order.
    """

    def __init__(self, address: str, *, ctx: zmq.asyncio.Context | None = None, curve: CurveServerKeys | None = None,
                 pool: BufferPool | None = None, allocate: Allocator | None = None,
                 release: Callable[[list[Any]], None] | None = None, max_bulk_bytes: int | None = None,
                 idle_timeout_s: float = 30.0, window_messages: int = DEFAULT_WINDOW_MESSAGES,
                 accept_cma: bool | None = None, name: str = "bulk-receiver"):
        self.address = address
        self.name = name
        self.max_bulk_bytes = envs.get().max_bulk_bytes if max_bulk_bytes is None else max_bulk_bytes
        self.idle_timeout_s = idle_timeout_s
        self.accepts_cma = address.startswith("ipc://") and cma.is_supported() if accept_cma is None else accept_cma
        self.stats = ChannelStats()
        if allocate is None and pool is not None:
            allocate, release = pool.allocate, pool.release_all
        self._allocate = allocate or (lambda specs: [np.empty(spec.num_bytes, np.uint8) for spec in specs])
        self._release = release
        self._window = window_messages
        self._ctx = ctx
        self._curve = curve
        self._codec = Codec(BulkFrame, max_frame_bytes=envs.get().max_control_frame_bytes)
        self._reply_codec = Codec(BulkReply)
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._pulls: set[asyncio.Task] = set()
        self._inflight: dict[Key, _Inflight] = {}
        self._receiving: Key | None = None  # transfer whose message is being read right now
        self._side_server: asyncio.AbstractServer | None = None
        self._side_writers: dict[bytes, asyncio.StreamWriter] = {}  # side-channel peer -> its stream
        self._side_tasks: set[asyncio.Task] = set()
        self._side_ids = itertools.count(1)
        self._done: asyncio.Queue[BulkTransfer] = asyncio.Queue()

    @property
    def num_in_progress(self) -> int:
        return len(self._inflight)

    async def start(self) -> str:
        self._sock = new_socket(self._ctx, zmq.ROUTER, curve=self._curve, rcvhwm=self._window)
        self._sock.rcvbuf = SOCKET_BUFFER_BYTES
        self.address = await bind(self._sock, self.address)
        if self.accepts_cma:
            await self._start_side_channel()
        self._tasks = [asyncio.create_task(self._recv_loop(), name=f"{self.name}-recv"),
                       asyncio.create_task(self._sweep_idle(), name=f"{self.name}-sweep")]
        return self.address

    async def recv(self) -> BulkTransfer:
        return await self._done.get()

    def __aiter__(self):
        return self

    async def __anext__(self) -> BulkTransfer:
        return await self.recv()

    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            try:
                peer = await sock.recv()
                if not sock.rcvmore:
                    self.stats.record_drop(MalformedFrame("bulk message without a header frame"), log, self.name)
                    continue
                header_frame = await sock.recv(copy=False)
                self.stats.num_received += 1
                try:
                    header = self._codec.decode(header_frame.buffer)
                except TransportError as err:
                    await self._discard_rest()
                    self.stats.record_drop(err, log, self.name)
                    continue
                if isinstance(header, BulkBegin):
                    await self._on_begin(peer, header)
                elif isinstance(header, BulkChunk):
                    await self._on_chunk(peer, header)
                else:  # BulkAbort
                    await self._discard_rest()
                    self._on_abort((peer, header.transfer_id))
            except (zmq.ZMQError, asyncio.CancelledError):
                return

    async def _on_begin(self, peer: bytes, begin: BulkBegin) -> None:
        key = (peer, begin.transfer_id)
        total = sum(spec.num_bytes for spec in begin.specs)
        if key in self._inflight:
            return await self._refuse(key, TransferFailed("transfer id already in progress"))
        if begin.chunk_bytes <= 0 or any(spec.num_bytes < 0 for spec in begin.specs):
            return await self._refuse(key, MalformedFrame("negative size or non-positive chunk"))
        if begin.source is not None:
            return await self._refuse(key, MalformedFrame("cross-memory transfers go over the side channel"))
        if total > self.max_bulk_bytes:
            return await self._refuse(key, OversizedFrame(
                f"transfer of {total} bytes is over the {self.max_bulk_bytes}-byte limit"))
        allocated = await self._allocate_for(key, begin)
        if allocated is None:
            return
        buffers, dests = allocated
        plan = plan_segments([spec.num_bytes for spec in begin.specs], begin.chunk_bytes)
        self._inflight[key] = _Inflight(begin=begin, buffers=buffers, dests=dests, plan=plan)
        await self._recv_message(key)

    async def _allocate_for(self, key: Key, begin: BulkBegin) -> tuple[list[Any], list[np.ndarray]] | None:
        """Destination buffers for ``begin`` (None: refused, the sender has been told)."""
        try:
            buffers = self._allocate(begin.specs)
            dests = [np.frombuffer(memoryview(b).cast("B"), np.uint8) for b in buffers]
            for dest, spec in zip(dests, begin.specs, strict=True):
                if not dest.flags.writeable or dest.nbytes < spec.num_bytes:
                    raise ValueError(f"buffer of {dest.nbytes} bytes for {spec.num_bytes}, or read-only")
        except Exception as exc:
            await self._refuse(key, TransferFailed(f"allocation failed: {exc}"))
            return None
        return buffers, dests

    async def _on_chunk(self, peer: bytes, chunk: BulkChunk) -> None:
        key = (peer, chunk.transfer_id)
        state = self._inflight.get(key)
        if state is None:  # refused, aborted or timed out earlier: its tail is expected, drop quietly
            await self._discard_rest()
            self.stats.num_late_replies += 1  # counted like a reply whose caller gave up
            return
        if chunk.seq != state.next_seq or chunk.seq >= len(state.plan):
            return await self._fail(key, TransferFailed(f"chunk {chunk.seq} arrived, expected {state.next_seq}"))
        await self._recv_message(key)

    def _on_abort(self, key: Key) -> None:
        state = self._inflight.get(key)
        if state is None:
            return
        if state.is_pulling:
            state.is_aborted = True  # the pull's own task frees the buffers when it returns
            return
        del self._inflight[key]
        self._free(state.buffers)

    async def _recv_message(self, key: Key) -> None:
        state = self._inflight[key]
        self._receiving = key
        try:
            error = await self._recv_frames(state, state.plan[state.next_seq])
        finally:
            self._receiving = None
        if error is not None:
            return await self._fail(key, error)
        state.next_seq += 1
        state.last_active = time.monotonic()
        if state.next_seq == len(state.plan):
            await self._complete(key, state)

    async def _complete(self, key: Key, state: _Inflight) -> None:
        del self._inflight[key]
        peer, tid = key
        await self._reply(peer, BulkAck(tid, ErrorCode.OK, sum(s.num_bytes for s in state.begin.specs)))
        self._done.put_nowait(BulkTransfer(transfer_id=tid, peer=peer, meta=state.begin.meta,
                                           specs=state.begin.specs, buffers=state.buffers,
                                           _release=self._release))

    async def _pull(self, key: Key, state: _Inflight, pid: int, source: CmaSource) -> None:
        """Copy a same-host sender's buffers straight out of its memory (see transport/cma.py)."""
        specs = state.begin.specs
        try:
            for address, dest, spec in zip(source.addresses, state.dests, specs):
                for offset in range(0, spec.num_bytes, _PULL_PIECE_BYTES):
                    piece = dest[offset:min(offset + _PULL_PIECE_BYTES, spec.num_bytes)]
                    cma.read_into(pid, address + offset, piece)
                    state.last_active = time.monotonic()
                    await asyncio.sleep(0)  # let the loop serve others between pieces
        except cma.CmaError as exc:
            code = ErrorCode.UNAVAILABLE if exc.errno in cma.FALLBACK_ERRNOS else ErrorCode.TRANSFER_FAILED
            error = TransferFailed(f"cross-memory pull failed: {exc}", code)
            return await self._fail(key, error, is_mid_message=False)
        state.is_pulling = False
        if state.is_aborted:
            del self._inflight[key]
            self._free(state.buffers)
            return
        await self._complete(key, state)

    async def _recv_frames(self, state: _Inflight, segments: list[Segment]) -> TransportError | None:
        sock = self._sock
        for segment in segments:
            if not sock.rcvmore:
                return MalformedFrame(f"message {state.next_seq} is missing segments")
            dest = state.dests[segment.index][segment.offset:segment.offset + segment.length]
            num_bytes = await sock.recv_into(dest)  # straight into place: the only receive-side copy
            if num_bytes != segment.length:
                return MalformedFrame(f"segment of {num_bytes} bytes where {segment.length} were planned")
        if sock.rcvmore:
            return MalformedFrame(f"message {state.next_seq} has extra frames")
        return None

    async def _fail(self, key: Key, error: TransportError, *, is_mid_message: bool = True) -> None:
        state = self._inflight.pop(key, None)
        if state is not None:
            self._free(state.buffers)
        await self._refuse(key, error, is_mid_message=is_mid_message)

    async def _refuse(self, key: Key, error: TransportError, *, is_mid_message: bool = True) -> None:
        if is_mid_message and key[0] not in self._side_writers:
            await self._discard_rest()
        self.stats.record_drop(error, log, self.name)
        await self._reply(key[0], BulkAck(key[1], error.code, 0, str(error)))

    async def _discard_rest(self) -> None:
        while self._sock.rcvmore:
            await self._sock.recv_into(bytearray())  # drops the frame without keeping it

    async def _reply(self, peer: bytes, reply: BulkAck) -> None:
        writer = self._side_writers.get(peer)
        if writer is not None:
            if not writer.is_closing():
                cma.write_frame(writer, self._reply_codec.encode(reply))
                self.stats.num_sent += 1
            return
        try:
            await self._sock.send_multipart([peer, self._reply_codec.encode(reply)])
            self.stats.num_sent += 1
        except zmq.ZMQError as exc:
            log.debug("%s: reply %s not sent: %s", self.name, reply, exc)

    def _free(self, buffers: list[Any]) -> None:
        if self._release is not None:
            self._release(buffers)

    async def _sweep_idle(self) -> None:
        """Drop transfers whose sender went quiet (died mid-stream) and free their buffers."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
            cutoff = time.monotonic() - self.idle_timeout_s
            for key, state in list(self._inflight.items()):
                if state.last_active < cutoff and key != self._receiving and not state.is_pulling:
                    await self._fail(key, TransferFailed(f"transfer idle for over {self.idle_timeout_s:g}s"),
                                     is_mid_message=False)

    async def close(self) -> None:
        if self._side_server is not None:
            self._side_server.close()  # no new side connections
            self._remove_side_socket()
        tasks = [*self._tasks, *self._side_tasks, *self._pulls]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        for state in self._inflight.values():
            self._free(state.buffers)
        self._inflight.clear()
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self) -> "BulkReceiver":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- same-host side channel (Unix socket next to the ipc:// path, see transport/cma.py) ----

    async def _start_side_channel(self) -> None:
        path = cma.side_path(self.address)
        self._remove_side_socket()  # a leftover of a receiver that was killed
        self._side_server = await asyncio.start_unix_server(self._serve_side, path)
        os.chmod(path, 0o600)  # cross-memory reads need the same user anyway

    def _remove_side_socket(self) -> None:
        path = cma.side_path(self.address)
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass

    async def _serve_side(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._side_tasks.add(task)
        peer = b"cma-%d" % next(self._side_ids)
        self._side_writers[peer] = writer
        try:
            pid = cma.peer_pid(writer)
            while True:
                body = await cma.read_frame(reader, self._codec.max_frame_bytes)
                self.stats.num_received += 1
                try:
                    msg = self._codec.decode(body)
                except TransportError as err:
                    self.stats.record_drop(err, log, self.name)
                    continue
                if isinstance(msg, BulkBegin):
                    await self._on_side_begin(peer, pid, msg)
                elif isinstance(msg, BulkAbort):
                    self._on_abort((peer, msg.transfer_id))
                else:
                    self.stats.record_drop(MalformedFrame("only BulkBegin/BulkAbort on the side channel"), log, self.name)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except ValueError as exc:  # oversized frame: the stream cannot be resynchronised
            self.stats.record_drop(OversizedFrame(str(exc)), log, self.name)
        finally:
            del self._side_writers[peer]
            for key in [k for k in self._inflight if k[0] == peer]:
                self._on_abort(key)  # the sender is gone: nobody wants these any more
            writer.close()
            self._side_tasks.discard(task)

    async def _on_side_begin(self, peer: bytes, pid: int, begin: BulkBegin) -> None:
        key = (peer, begin.transfer_id)
        total = sum(spec.num_bytes for spec in begin.specs)
        if key in self._inflight:
            return await self._refuse(key, TransferFailed("transfer id already in progress"))
        if begin.source is None or len(begin.source.addresses) != len(begin.specs) or any(
                spec.num_bytes < 0 for spec in begin.specs):
            return await self._refuse(key, MalformedFrame("side-channel transfer without a matching address list"))
        if total > self.max_bulk_bytes:
            return await self._refuse(key, OversizedFrame(
                f"transfer of {total} bytes is over the {self.max_bulk_bytes}-byte limit"))
        allocated = await self._allocate_for(key, begin)
        if allocated is None:
            return
        state = _Inflight(begin=begin, buffers=allocated[0], dests=allocated[1], plan=[], is_pulling=True)
        self._inflight[key] = state
        task = asyncio.create_task(self._pull(key, state, pid, begin.source))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
