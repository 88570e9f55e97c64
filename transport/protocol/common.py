"""The base classes and what every channel shares: error codes, roles, the error reply.

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, frozen=True):
    """Base of every wire message (tag = class name)."""


class _HotMessage(_Message, gc=False):
    """Base of messages sent at high rate: not tracked by the cycle collector."""


# =====================================================================================
# Common: error codes, roles, the error reply every request/response channel may return.
# =====================================================================================


class ErrorCode(enum.IntEnum):
    OK = 0
    MALFORMED = 1  # not decodable (bad msgpack, wrong number of frames, bad envelope)
    UNEXPECTED_MESSAGE = 2  # decodable, but not a message this channel accepts
    OVERSIZED = 3  # a frame or transfer over the receiver's limit
    DEADLINE_EXCEEDED = 4  # no reply before the caller's deadline
    DRAINING = 5  # the receiver is draining and accepts no new work
    HANDLER_FAILED = 6  # the receiver's handler raised
    CLOSED = 7  # the channel was closed while the operation was pending
    TRANSFER_FAILED = 8  # a bulk transfer broke off (sender gone, bad segment, idle too long)
    UNAVAILABLE = 9  # the peer is down or unknown
    NOT_FOUND = 10  # the addressed object does not exist
    FORBIDDEN = 11  # the peer may not send this message (e.g. a storage admin message from afar)


class Role(enum.IntEnum):
    GATEWAY = 1
    ENCODER = 2
    PREFILL = 3
    DECODE = 4
    STORAGE = 5


class ErrorReply(_Message):
    """Any request/response channel answers with this when it cannot produce a normal reply."""

    code: ErrorCode
    message: str = ""
