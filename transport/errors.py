"""Typed transport errors: each carries the wire ``ErrorCode`` it corresponds to.

Callers catch ``TransportError`` (or a subclass) and branch on ``.code``; an ``ErrorReply``
received from a peer surfaces as ``RemoteError`` with the peer's code and message.
"""

from __future__ import annotations

from deepinfer.transport.protocol import ErrorCode, ErrorReply


class TransportError(Exception):
    code: ErrorCode = ErrorCode.HANDLER_FAILED

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, message=str(self))


class MalformedFrame(TransportError):
    code = ErrorCode.MALFORMED


class UnexpectedMessage(TransportError):
    code = ErrorCode.UNEXPECTED_MESSAGE


class OversizedFrame(TransportError):
    code = ErrorCode.OVERSIZED


class DeadlineExceeded(TransportError):
    code = ErrorCode.DEADLINE_EXCEEDED


class ChannelClosed(TransportError):
    code = ErrorCode.CLOSED


class TransferFailed(TransportError):
    code = ErrorCode.TRANSFER_FAILED


class RemoteError(TransportError):
    """The peer answered with an ErrorReply (``code`` is the peer's)."""

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> "RemoteError":
        return cls(f"peer error {reply.code.name}: {reply.message}", reply.code)
