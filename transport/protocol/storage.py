"""Storage cluster messages (cache/store/).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

import enum

from deepinfer.transport.protocol.common import ErrorReply, _HotMessage, _Message


# =====================================================================================
# Storage cluster: ROUTER (storage node) <- DEALER (store clients: engines, tools, benchmarks).
# Request frames: [request_id u64le, body, payload, payload, ...]; replies the same.
# Fragment payloads travel as raw attachments (zero-copy), attachment i belonging to the i-th
# FragmentMeta of the message. A node holds at most one fragment per object key.
# =====================================================================================


class FragmentStatus(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    CORRUPT = 2  # failed its checksum on the node: counted, deleted, never served
    EXPIRED = 3  # past its traffic class's TTL
    NO_SPACE = 4  # does not fit even after garbage collection
    INVALID = 5  # malformed write (bad key, payload does not match its crc)
    TOO_LARGE = 6  # larger than the node's whole capacity: can never fit


class FragmentMeta(_HotMessage):
    """Everything about a fragment but its payload (see cache/store/ec.py FragmentHeader)."""

    key: bytes
    index: int
    k: int
    m: int
    object_size: int
    payload_crc: int
    write_id: int
    expires_at: float = 0.0  # on puts: keep this expiry (wall clock; repairs keep the original); 0 = TTL of the class


class PutFragments(_HotMessage):
    traffic_class: str  # decides the TTL on the node ("agent", "chat", ...)
    fragments: list[FragmentMeta]


class GetFragments(_HotMessage):
    keys: list[bytes]
    timeout_ms: float = 0.0  # the caller's remaining budget; the node skips work past it (0: none)


class TouchFragments(_HotMessage):
    """Mark fragments as just used, without reading them (LRU for nodes a read did not need)."""

    keys: list[bytes]


class StorageStatsRequest(_Message):
    pass


class HasFragments(_HotMessage):
    """Which fragment of each key the node holds (the repair audit's question; no payloads)."""

    keys: list[bytes]


class FragmentIndex(_HotMessage):
    indices: list[int]  # one per key: the fragment index held, -1 when none, -2 evicted by GC lately
    write_ids: list[int]  # the held fragment's write id (0 when none)
    payload_crcs: list[int] = []  # the held fragment's payload CRC-32C (0 when none)


class RepairHint(_HotMessage):
    """Objects seen short of fragments (a degraded write, a read that found fragments missing or
    corrupt): the node checks them before its periodic audit would, and repairs what it can."""

    keys: list[bytes]


class RepairHintAck(_HotMessage):
    num_queued: int


class RunGc(_Message):
    pass


class DebugSet(_Message):
    """Test-only (refused unless the node runs with --debug-hooks): set the node's wall clock
    (``now`` > 0) and/or its per-request delay (``delay_ms`` >= 0), then run GC."""

    now: float = 0.0
    delay_ms: float = -1.0


class PutAck(_HotMessage):
    statuses: list[FragmentStatus]  # one per fragment, in order


class FragmentsReply(_HotMessage):
    statuses: list[FragmentStatus]  # one per requested key, in order
    fragments: list[FragmentMeta] = []  # one per OK status, in order; payload i = attachment i


class TouchAck(_HotMessage):
    num_touched: int


class StorageStats(_Message):
    node_name: str
    num_fragments: int
    used_bytes: int
    capacity_bytes: int
    high_watermark_bytes: int
    low_watermark_bytes: int
    num_puts: int
    num_gets: int
    num_hits: int
    num_misses: int
    num_expired: int
    num_evicted: int
    num_corrupt: int
    num_rejected: int
    num_bytes_written: int
    num_bytes_read: int
    read_GBps: float  # over the last few seconds
    write_GBps: float
    uptime_s: float
    # repair and scrub (cache/store/repair.py, scrub.py); appended: older peers omit them
    num_repaired: int = 0  # fragments this node rebuilt (decoded + written) onto nodes lacking them
    num_moved: int = 0  # fragments this node moved to the node its group now ranks
    num_dropped: int = 0  # surplus fragments (duplicates, misplaced copies) this node deleted
    num_repair_bytes: int = 0  # fragment payload bytes written by repair and moves
    num_repair_failures: int = 0
    num_under_replicated: int = 0  # objects known short of k+m fragments, waiting for repair
    num_audited: int = 0  # objects whose fragments the audit counted across their group
    audit_progress: float = 0.0  # of the current audit pass, 0..1
    num_scrubbed: int = 0  # fragments whose checksums the scrub verified
    num_scrub_errors: int = 0  # corrupt or vanished fragments the scrub found (then rebuilt)
    membership_epoch: int = -1  # -1: the node runs without a membership record (no repair)
    num_admin_refused: int = 0


class GcDone(_Message):
    num_expired: int
    num_evicted: int
    num_bytes_freed: int


StorageRequest = (
    PutFragments | GetFragments | TouchFragments | StorageStatsRequest | RunGc | DebugSet | HasFragments | RepairHint
)
StorageReply = PutAck | FragmentsReply | TouchAck | StorageStats | GcDone | FragmentIndex | RepairHintAck | ErrorReply
