"""SWA slot messages (cache/swa_directory.py, cache/swa_fetch.py).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

import enum

from deepinfer.transport.protocol.common import ErrorReply, _HotMessage, _Message


# =====================================================================================
# SWA slots (cache/swa_directory.py, cache/swa_fetch.py).
# Events: PUB (slot owner) -> SUB (SWA directory), topic TOPIC_SWA, frames [topic, body]; or,
# where the directory does not know the owner's event socket (standalone engines), the owner
# sends the same SwaSlotEvents as a request to the directory: -> SwaEventsAck.
# Directory: ROUTER (directory) <- DEALER (prefill engines): SwaLocate -> SwaLocations.
# Fetch: ROUTER (owner's slot server) <- DEALER (requester): SwaFetch -> SwaFetchReply; on FOUND
# the owner first pushes the packed slot over the bulk data plane to ``reply_to`` (one buffer,
# meta = encoded SwaSlotHeader) and replies once the requester holds every byte.
# =====================================================================================

TOPIC_SWA = b"swa"


class SwaSlotEvents(_HotMessage):
    """An owner's slot changes since its last message (``is_full``: the whole set it holds,
    sent periodically so a directory that missed messages converges)."""

    node_name: str
    instance_id: int
    fetch_address: str  # the owner's SwaFetch server
    saved: list[bytes] = []  # prefix hashes at slot boundaries
    saved_num_tokens: list[int] = []  # boundary position of each saved slot
    evicted: list[bytes] = []
    is_full: bool = False


class SwaLocate(_Message):
    keys: list[bytes]


class SwaLocation(_Message):
    node_name: str
    fetch_address: str
    num_tokens: int


class SwaLocations(_Message):
    locations: list[SwaLocation | None]  # one per requested key, in order


class SwaFetch(_Message):
    key: bytes
    fetch_id: int
    reply_to: str  # the requester's bulk receiver
    layout_fingerprint: str  # slot layouts must agree (same model and ring formats)


class SwaFetchStatus(enum.IntEnum):
    FOUND = 0
    NOT_FOUND = 1
    LAYOUT_MISMATCH = 2


class SwaFetchReply(_Message):
    fetch_id: int
    status: SwaFetchStatus
    num_tokens: int = 0
    num_bytes: int = 0


class SwaSlotHeader(_Message):
    """Bulk meta of a pushed slot."""

    fetch_id: int
    key: bytes
    num_tokens: int
    layout_fingerprint: str


class SwaEventsAck(_Message):
    """Reply to SwaSlotEvents sent as a request: how many keys the directory now lists for that node."""

    num_keys: int = 0


SwaEvent = SwaSlotEvents
SwaDirectoryRequest = SwaLocate | SwaSlotEvents
SwaDirectoryReply = SwaLocations | SwaEventsAck | ErrorReply
SwaFetchRequest = SwaFetch
SwaFetchReplyUnion = SwaFetchReply | ErrorReply
