"""Prefill/decode handoff messages (runtime/disagg/).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

import enum

from deepinfer.transport.protocol.common import ErrorCode, ErrorReply, Role, _HotMessage, _Message


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
#   cache       engine PUB (NodeSpec.events) topic TOPIC_KV_EVENTS -> gateway SUB: KvCacheEvents
#               (a gateway that missed one asks the engine RPC for a PdCacheSnapshot)
# Opaque ``bytes`` fields (sampling, output, logprobs) hold msgpack of the engine layer's own
# dataclasses (SamplingParams, RequestOutput, ...), encoded/decoded by msgspec with their types:
# transport depends on nothing of ours, and no pickle crosses the wire.
# =====================================================================================

TOPIC_PD_LOAD = b"pdload"
TOPIC_KV_EVENTS = b"kvevents"


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


class PdImage(_HotMessage):
    """An image's span of prompt positions (its embeddings come from an encoder node, into the
    prefill engine's embedding inbox under (request_id@attempt, image index); runtime/encoder/)."""

    offset: int
    length: int
    content_hash: str


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
    images: list[PdImage] = []  # the prompt's image spans, in order (their embeddings: the prefill's inbox)


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
    images: list[PdImage] = []  # the prompt's image spans: they salt the decode engine's block hashes


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
    num_cached_tokens: int = 0  # prompt tokens the prefill found cached (any tier)
    cached_tokens_by_tier: dict[str, int] = {}  # "device" / "host" / "store" -> tokens


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
    kv_events_seq: int = 0  # the last KvCacheEvents seq published: a gateway behind it lost some


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
    kv: dict[str, int] = {}  # prefix cache and KV tier counters (KVOffloadStats, cached blocks, hits)
    spec: dict[str, int] = {}  # DSpark counters (engine/spec/decoding.py SpecStats, integer ones); {} without


class KvCacheEvents(_HotMessage):
    """engine -> gateways (PUB, TOPIC_KV_EVENTS), and the reply to PdCacheSnapshot: block hashes
    (cache/block_hash.py, over ``block_size``-token blocks rooted at ``model_id``) its prefix cache
    gained (``stored``) and lost (``evicted``), and those the KV store acknowledged
    (``store_written``). ``seq`` counts this instance's messages from 1; a subscriber that sees a
    gap (or a load report's ``kv_events_seq`` ahead of it) lost events and asks for a snapshot:
    ``is_snapshot`` messages list every block cached now in ``stored`` and replace what was known."""

    node_name: str
    instance_id: int
    seq: int
    model_id: str
    block_size: int
    stored: list[bytes] = []
    evicted: list[bytes] = []
    store_written: list[bytes] = []
    is_snapshot: bool = False


class PdCacheSnapshot(_Message):
    """gateway -> engine RPC: every block hash cached now, as a KvCacheEvents with is_snapshot."""


PdEngineRequest = PdDispatch | PdKvReady | PdAbort | PdLeaseRenew | PdStatusRequest | PdCacheSnapshot
PdEngineReply = PdDispatchReply | PdHandoffAck | PdDone | PdEngineStatus | KvCacheEvents | ErrorReply
PdStream = PdOutput | PdFailed
PdLoadEvent = PdLoadReport
