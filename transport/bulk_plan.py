"""Pieces both ends of the bulk data plane share: the segment plan and the result types."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from deepinfer.transport.buffers import typed_view
from deepinfer.transport.protocol import BufferSpec

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_WINDOW_MESSAGES = 4  # messages in flight per sender (high-water mark)
SOCKET_BUFFER_BYTES = 4 << 20  # kernel socket buffers: fewer syscalls per chunk


class Segment(NamedTuple):
    index: int  # which buffer
    offset: int
    length: int


def plan_segments(sizes: Sequence[int], chunk_bytes: int) -> list[list[Segment]]:
    """Cut buffers of ``sizes`` into messages of at most ``chunk_bytes``; both sides call this.

    Segments never cross a buffer boundary; a message may hold the tail of one buffer and the
    head of the next. Zero buffers (or only empty ones) still make one (empty) message.
    """
    messages: list[list[Segment]] = [[]]
    room = chunk_bytes
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            if room == 0:
                messages.append([])
                room = chunk_bytes
            length = min(size - offset, room)
            messages[-1].append(Segment(index, offset, length))
            offset += length
            room -= length
    return messages


@dataclass(frozen=True, slots=True)
class TransferResult:
    transfer_id: int
    num_bytes: int
    seconds: float  # first frame queued -> OK ack received


@dataclass(slots=True)
class BulkTransfer:
    """A completed transfer as the receiver sees it. Call ``release()`` when done with it."""

    transfer_id: int
    peer: bytes
    meta: bytes
    specs: list[BufferSpec]
    buffers: list[Any]  # what the allocator returned, filled
    _release: Callable[[list[Any]], None] | None = None

    @property
    def num_bytes(self) -> int:
        return sum(spec.num_bytes for spec in self.specs)

    def view(self, index: int) -> Any:
        """Buffer ``index`` as a numpy array (or torch tensor for ``torch.*`` dtypes), no copy."""
        return typed_view(self.buffers[index], self.specs[index])

    def release(self) -> None:
        if self._release is not None:
            self._release(self.buffers)
            self._release = None


Allocator = Callable[[list[BufferSpec]], list[Any]]
