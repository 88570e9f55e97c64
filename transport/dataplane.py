"""Bulk data plane: move tensors/arrays/bytes between processes without extra copies.

    sender = await BulkSender("ipc:///run/x.sock").start()       # or tcp://HOST:PORT
    result = await sender.send([tensor, array, b"bytes"], meta=encoded_description, timeout_s=30)
    receiver = BulkReceiver("ipc:///run/x.sock", pool=BufferPool()); await receiver.start()
    transfer = await receiver.recv(); t0 = transfer.view(0); ...; transfer.release()

Wire (bulk section of ``protocol``): ``BulkSender`` (DEALER) -> ``BulkReceiver`` (ROUTER). A
transfer of buffers ``b0, b1, ...`` is cut into messages of at most ``chunk_bytes`` payload::

    payload   |<----- b0 ----->|<-------------- b1 -------------->|
    messages  [BulkBegin, b0, b1[:c-|b0|]] [BulkChunk 1, b1[...]] ...   (c = chunk_bytes)

so large payloads stream through bounded queues (``window_messages`` in flight): a 256 MiB
transfer never sits in libzmq's memory at once.

- ``tcp://``: segments are ZeroMQ frames sent with ``copy=False`` straight from the caller's
  memory and received with ``recv_into`` straight into the destination buffer (the one
  receive-side copy is out of libzmq's frame).
- ``ipc://`` (same host, Linux): the sender names its buffers' addresses on the receiver's
  Unix-socket side channel (``PATH.cma`` next to the ``ipc://`` path) and the receiver copies
  them straight out of the sender's memory with ``process_vm_readv`` (``transport.cma``): one
  copy in total, one small message each way, no payload through a kernel socket and no libzmq
  thread hand-offs. The kernel tells the receiver the sender's pid, so a peer can only point
  it at its own memory. Without a side channel the sender sends frames; where the kernel
  refuses the read the receiver answers ``UNAVAILABLE`` and the sender sends frames from then
  on. ``use_cma=False`` / ``accept_cma=False`` force frames.
- Destinations are allocated on ``BulkBegin`` for the announced sizes (``allocate(specs)``,
  a ``BufferPool`` or ``np.empty``); nothing is received into throwaway objects.
- Every transfer has an id and ends in exactly one ``BulkAck``: ``OK`` when the receiver holds
  every byte, else an error code (``OVERSIZED`` over ``max_bulk_bytes``, ``TRANSFER_FAILED``
  for bad segments or sequence, a sender idle past ``idle_timeout_s``). A sender that gives up
  (deadline, cancelled) sends ``BulkAbort`` and the receiver frees that transfer's buffers.
- Send buffers must stay unchanged until ``send`` returns. A transfer the sender gave up on
  can still complete at the receiver (the abort races the last bytes); the caller's own
  protocol (an explicit abort of the request) settles which side wins.
- CURVE keys protect the ZeroMQ sockets; the side channel is a Unix socket of mode 0600
  (same host, same user, as cross-memory reads require anyway).

Another transport (UCX/NIXL/RDMA) slots in by implementing ``BulkSendEndpoint`` and
``BulkRecvEndpoint`` below with the same result types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from deepinfer.transport.bulk_plan import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WINDOW_MESSAGES,
    Allocator,
    BulkTransfer,
    Segment,
    TransferResult,
    plan_segments,
)
from deepinfer.transport.bulk_receiver import BulkReceiver
from deepinfer.transport.bulk_sender import BulkSender

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_WINDOW_MESSAGES",
    "Allocator",
    "BulkRecvEndpoint",
    "BulkReceiver",
    "BulkSendEndpoint",
    "BulkSender",
    "BulkTransfer",
    "Segment",
    "TransferResult",
    "plan_segments",
]


class BulkSendEndpoint(Protocol):
    async def start(self) -> Any: ...

    async def send(self, buffers: Sequence[Any], *, meta: bytes = b"", timeout_s: float | None = None) -> TransferResult: ...

    async def close(self) -> None: ...


class BulkRecvEndpoint(Protocol):
    address: str

    async def start(self) -> str: ...

    async def recv(self) -> BulkTransfer: ...

    async def close(self) -> None: ...
