"""Bulk data plane messages (transport/dataplane.py, transport/cma.py).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations


from deepinfer.transport.protocol.common import ErrorCode, _HotMessage, _Message


# =====================================================================================
# Bulk data plane: DEALER (sender) -> ROUTER (receiver), acks back on the same pair.
# A transfer is a sequence of messages (a ROUTER receiver sees the sender's identity first):
#   [BulkBegin, seg, seg, ...]  [BulkChunk(seq=1), seg, ...]  [BulkChunk(seq=2), seg, ...]
# where the payload (the concatenation of all buffers) is cut into segments that never cross a
# buffer boundary and each message carries at most ``chunk_bytes`` of them; both sides derive
# the same plan from (specs, chunk_bytes). On one host BulkBegin may instead carry a CmaSource
# (on a Unix-socket side channel, frames [u32le length, body]): the message is then the header
# alone and the receiver pulls the bytes from the sender's memory. The receiver answers each
# transfer with exactly one BulkAck; a sender that gives up sends BulkAbort.
# See transport/dataplane.py and transport/cma.py.
# =====================================================================================


class BufferSpec(_HotMessage):
    """One buffer of a transfer. ``dtype`` is a numpy dtype string or ``torch.<name>``;
    ``shape`` None means a flat 1-D buffer."""

    num_bytes: int
    dtype: str = "uint8"
    shape: tuple[int, ...] | None = None


class CmaSource(_HotMessage):
    """Same-host fast path: the receiver copies the buffers straight out of the sender's memory
    (Linux cross-memory attach) instead of receiving frames. ``addresses[i]`` is buffer i's
    address in the sender. Only sent on the receiver's Unix-socket side channel, where the
    kernel tells the receiver the sender's pid (SO_PEERCRED): a peer can only ever point the
    receiver at its own memory."""

    addresses: list[int]


class BulkBegin(_HotMessage):
    transfer_id: int
    specs: list[BufferSpec]
    chunk_bytes: int
    meta: bytes = b""  # opaque to the data plane: the caller's own encoded description
    source: CmaSource | None = None  # set: no segment frames follow, the receiver pulls the data


class BulkChunk(_HotMessage):
    transfer_id: int
    seq: int  # 1, 2, ... (BulkBegin is message 0)


class BulkAbort(_Message):
    """The sender gives up on a transfer (deadline, caller cancelled): free its buffers now."""

    transfer_id: int
    reason: str = ""


class BulkAck(_HotMessage):
    """The receiver holds every byte of the transfer (code OK), or gave up on it (code != OK)."""

    transfer_id: int
    code: ErrorCode
    num_bytes: int = 0
    message: str = ""


BulkFrame = BulkBegin | BulkChunk | BulkAbort
BulkReply = BulkAck
