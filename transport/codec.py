"""A reusable typed encoder/decoder pair for one union of protocol messages.

One ``Codec`` per socket (msgspec encoders/decoders are cheap to call and costly to build).
``decode`` turns every way a frame can be bad into a typed ``TransportError``:
over the size limit -> ``OversizedFrame``; not msgpack -> ``MalformedFrame``; msgpack but not a
message of this union (unknown tag, wrong field type) -> ``UnexpectedMessage``. Nothing is ever
unpickled.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from deepinfer.transport.errors import MalformedFrame, OversizedFrame, UnexpectedMessage

T = TypeVar("T")


class Codec(Generic[T]):
    __slots__ = ("union", "max_frame_bytes", "_encoder", "_decoder")

    def __init__(self, union: Any, max_frame_bytes: int | None = None):
        self.union = union
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def encode_into(self, msg: Any, buf: bytearray, offset: int = 0) -> None:
        """Encode into a reused bytearray (resized to fit) to keep allocation off hot paths."""
        self._encoder.encode_into(msg, buf, offset)

    def decode(self, frame: bytes | memoryview) -> T:
        size = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
        if self.max_frame_bytes is not None and size > self.max_frame_bytes:
            raise OversizedFrame(f"frame of {size} bytes is over the {self.max_frame_bytes}-byte limit")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raise UnexpectedMessage(f"not a {_union_name(self.union)} message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise MalformedFrame(f"undecodable frame: {exc}") from None


def _union_name(union: Any) -> str:
    args = getattr(union, "__args__", None)
    if args:
        return " | ".join(a.__name__ for a in args)
    return getattr(union, "__name__", str(union))
