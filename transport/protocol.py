"""Every message DeepInfer puts on the wire, as msgspec Structs — the one protocol module.

Conventions (follow them when adding a section):

- One tagged union per channel *direction* (``NodeControlRequest``, ``NodeControlReply``, ...).
  The tag is the class name (``tag=True``), written as the first array element, so a decoder
  typed for one union rejects a message meant for another channel with a typed error.
- ``array_like=True`` (positional arrays, no field names on the wire) and ``omit_defaults=True``.
  Adding a field: append it at the END with a default, so older peers still decode.
- ``gc=False`` on hot messages (sent per step, per chunk or per heartbeat). Those Structs must
  never hold reference cycles.
- Enums are ``IntEnum`` (ints on the wire).
- Decode with one reused ``deepinfer.transport.codec.Codec(UNION)`` per socket; never pickle.

Sections: common, node control (ROUTER/DEALER), peer events (PUB/SUB), bulk data plane.
Later sections (storage, engine requests/outputs, P/D handoff, cache events) go at the end, each
under its own banner naming its channel and direction.
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


# =====================================================================================
# Node control channel: ROUTER (node) <- DEALER (peers, operators).
# Request frames: [request_id u64le, body]; reply frames: [request_id u64le, body].
# =====================================================================================


class Hello(_Message):
    """Introduces the caller. ``instance_id`` is random per process start, so a restarted peer
    is never confused with its previous life."""

    node_name: str
    role: Role
    instance_id: int
    protocol_version: int = PROTOCOL_VERSION


class Drain(_Message):
    """Ask the node to drain: refuse new work, finish in-flight work within ``deadline_s``."""

    deadline_s: float


class StatusRequest(_Message):
    pass


class Welcome(_Message):
    """Reply to Hello: who answered."""

    node_name: str
    role: Role
    instance_id: int
    protocol_version: int = PROTOCOL_VERSION


class DrainAck(_Message):
    node_name: str
    num_in_flight: int


class NodeStatus(_Message):
    node_name: str
    role: Role
    instance_id: int
    is_draining: bool
    uptime_s: float
    peers_up: list[str] = []


NodeControlRequest = Hello | Drain | StatusRequest
NodeControlReply = Welcome | DrainAck | NodeStatus | ErrorReply


# =====================================================================================
# Peer events: PUB (every node) -> SUB (every peer). Frames: [topic, body].
# Heartbeats go out under TOPIC_HEARTBEAT; the node's own view of its peers (PeerUp/PeerDown)
# under TOPIC_PEER so local and remote subscribers see the same events.
# =====================================================================================

TOPIC_HEARTBEAT = b"hb"
TOPIC_PEER = b"peer"


class DownReason(enum.IntEnum):
    MISSED_BEATS = 1  # no heartbeat for missed_beats intervals
    RESTARTED = 2  # a heartbeat arrived with a new instance id
    LEFT = 3  # the peer said goodbye (graceful stop)


class Heartbeat(_HotMessage):
    node_name: str
    role: Role
    instance_id: int
    seq: int
    is_draining: bool = False


class Leave(_Message):
    """Sent once by a node that stops gracefully, so peers need not wait for missed beats."""

    node_name: str
    instance_id: int


class PeerUp(_Message):
    node_name: str
    role: Role
    instance_id: int


class PeerDown(_Message):
    node_name: str
    role: Role
    instance_id: int
    reason: DownReason


PeerEvent = Heartbeat | Leave | PeerUp | PeerDown


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


# =====================================================================================
# Later sections go below, one banner each (channel, direction, frame layout):
# storage cluster, engine requests/outputs, P/D handoff, cache events.
# =====================================================================================


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


# =====================================================================================
# P/D handoff (owner: pd-disagg; see runtime/disagg/__init__.py for the whole flow).
# Four channels, every peer named with its instance id so a restarted engine is never
# mistaken for its previous life (a message naming an old instance is refused UNAVAILABLE):
#   engine RPC  ROUTER (prefill/decode, NodeSpec.engine) <- DEALER (gateway, peer engines):
#               frames as the node control channel; PdEngineRequest -> PdEngineReply
#   bulk        prefill BulkSender -> decode BulkReceiver (decode NodeSpec.data); the
#               transfer's ``meta`` is an encoded PdKvPush, its buffers the KV (names in it)
#   stream      decode (or prefill) PUSH -> gateway PULL (gateway NodeSpec.data): PdStream
#   load        engine PUB (NodeSpec.events) topic TOPIC_PD_LOAD -> gateway SUB: PdLoadReport
# Opaque ``bytes`` fields (sampling, output, logprobs) hold msgpack of the engine layer's own
# dataclasses (SamplingParams, RequestOutput, ...), encoded/decoded by msgspec with their types:
# transport depends on nothing of ours, and no pickle crosses the wire.
# =====================================================================================

TOPIC_PD_LOAD = b"pdload"


class FailurePolicy(enum.IntEnum):
    RECOMPUTE = 0  # a lost engine: re-dispatch (another prefill; resume after the streamed tokens)
    FAIL = 1  # a lost engine: the request ends with a clear error


class HandoffStatus(enum.IntEnum):
    HANDED_OFF = 1  # the decode engine acknowledged: it streams the rest to the gateway
    FINISHED = 2  # the request ended at the prefill (first token was EOS/stop/max_tokens)


class EngineRef(_HotMessage):
    """One engine *instance*: who it is and where its RPC and data sockets are."""

    node_name: str
    instance_id: int
    engine_address: str  # its engine RPC ROUTER
    data_address: str = ""  # its bulk receiver (decode engines)


class PdDispatch(_Message):
    """gateway -> prefill: run this prompt, then hand the request to ``decode``.
    ``seed`` is resolved by the gateway so every attempt samples the same stream;
    ``resume_token_ids`` are outputs already streamed to the client by a lost decode engine
    (they are part of the sequence, not sent again)."""

    request_id: str
    attempt: int
    prompt_token_ids: list[int]
    sampling: bytes  # msgpack SamplingParams
    seed: int
    prefill_instance_id: int  # the instance the gateway means (a restarted one refuses)
    decode: EngineRef
    gateway_name: str
    gateway_instance_id: int
    stream_address: str  # the gateway's PULL socket the decode engine streams to
    resume_token_ids: list[int] = []
    deadline_s: float = 0.0  # seconds the prefill may spend before giving up (0: its default)


class PdKvPush(_Message):
    """The handoff header (meta of the bulk transfer prefill -> decode). The transfer's
    buffers are the KV, in ``buffer_names`` order: ``"b.<layer>.<name>"`` is one paged tensor's
    rows of the request's ``num_blocks`` blocks stacked ``[num_blocks, rows, width]``,
    ``"s.<layer>.<name>"`` one ring of its SWA slot ``[capacity, width]``."""

    handoff_id: int
    request_id: str
    attempt: int
    prefill: EngineRef
    decode_instance_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # resumed + first sampled token: position, penalty counts, grammar
    sampling: bytes  # msgpack SamplingParams (the request's own, not the prefill's forced ones)
    seed: int
    num_computed_tokens: int  # positions [0, n) have KV in the buffers
    block_size: int
    num_blocks: int
    buffer_names: list[str]
    gateway_name: str
    gateway_instance_id: int
    stream_address: str
    lease_s: float
    first_logprobs: bytes = b""  # msgpack list[PositionLogprobs] of the first token ("" if none)
    prompt_logprobs: bytes = b""  # msgpack list[PositionLogprobs | None] ("" if not asked)
    window_start: int = 0  # the request's replay bounds after a prefix hit (engine/core/batch.py)
    write_from: int = 0


class PdKvReady(_Message):
    """prefill -> decode, after the bulk transfer was acknowledged: import it and answer
    PdHandoffAck. Only after an OK ack does the prefill free its copy."""

    handoff_id: int
    request_id: str
    attempt: int
    prefill_instance_id: int
    decode_instance_id: int


class PdAbort(_Message):
    """Any direction: drop this request (every attempt when ``attempt`` < 0) and everything it
    holds. gateway -> engine on client disconnect/deadline; prefill -> decode when it gives up a
    handoff; decode -> prefill when it refuses one."""

    request_id: str
    attempt: int = -1
    reason: str = ""


class PdLeaseRenew(_HotMessage):
    """decode -> prefill: keep the KV of these handoffs for another ``lease_s`` (the decode
    engine holds their transfers but has not imported them yet, e.g. no free slot)."""

    decode_name: str
    decode_instance_id: int
    handoff_ids: list[int]
    lease_s: float


class PdDispatchReply(_Message):
    request_id: str
    attempt: int
    status: HandoffStatus
    output: bytes = b""  # FINISHED: msgpack of the final RequestOutput delta
    handoff_bytes: int = 0
    handoff_s: float = 0.0  # export + transfer + import + ack


class PdHandoffAck(_Message):
    handoff_id: int
    request_id: str
    code: ErrorCode
    message: str = ""


class PdDone(_Message):
    """Reply to PdAbort / PdLeaseRenew: how many requests or leases it touched."""

    num_affected: int = 0


class PdOutput(_HotMessage):
    """decode -> gateway: one RequestOutput delta (msgpack) of ``request_id``'s ``attempt``."""

    request_id: str
    attempt: int
    engine_instance_id: int
    output: bytes


class PdFailed(_Message):
    """engine -> gateway: this attempt ended without output (engine abort, import failed)."""

    request_id: str
    attempt: int
    engine_instance_id: int
    code: ErrorCode
    message: str = ""


class PdLoadReport(_HotMessage):
    """engine -> gateways, a few times a second: what the balancers weigh."""

    node_name: str
    role: Role
    instance_id: int
    num_requests: int  # running + waiting
    num_kv_tokens: int  # KV length of those requests
    backlog_s: float  # predicted compute seconds queued (prefill)
    max_requests: int
    kv_capacity_tokens: int
    is_draining: bool = False


class PdStatusRequest(_Message):
    pass


class PdEngineStatus(_Message):
    """An engine's handoff state (tests, operators, ``deepinfer bench pd``)."""

    node_name: str
    role: Role
    instance_id: int
    num_requests: int
    num_held_handoffs: int  # prefill: leases on exported KV not yet acknowledged
    held_bytes: int
    num_pending_imports: int  # decode: transfers received, not yet imported
    num_handoffs: int
    handoff_bytes: int
    handoff_p50_s: float
    handoff_p99_s: float
    handoff_GBps: float
    failures: dict[str, int] = {}
    swa: dict[str, int] = {}  # SWA slot counters (engine/kv/swa_slots.py SwaSlotStats); {} without slots


PdEngineRequest = PdDispatch | PdKvReady | PdAbort | PdLeaseRenew | PdStatusRequest
PdEngineReply = PdDispatchReply | PdHandoffAck | PdDone | PdEngineStatus | ErrorReply
PdStream = PdOutput | PdFailed
PdLoadEvent = PdLoadReport


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
