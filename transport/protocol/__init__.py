"""Every message DeepInfer puts on the wire, as msgspec Structs — the one protocol package.

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

One module per channel family, each section under a banner naming its channel, direction and
frame layout: ``common`` (bases, error codes, roles), ``node`` (node control, peer events),
``bulk`` (the bulk data plane), ``storage`` (the storage cluster), ``pd`` (prefill/decode handoff),
``swa`` (SWA slots), ``ep`` (an expert-parallel engine group's front and its ranks). Import
messages from here (``deepinfer.transport.protocol``); add a section as a module of its own and
list its names below.
"""

from deepinfer.transport.protocol.common import (  # noqa: F401
    PROTOCOL_VERSION,
    ErrorCode,
    Role,
    ErrorReply,
)
from deepinfer.transport.protocol.node import (  # noqa: F401
    Hello,
    Drain,
    StatusRequest,
    Welcome,
    DrainAck,
    NodeStatus,
    NodeControlRequest,
    NodeControlReply,
    TOPIC_HEARTBEAT,
    TOPIC_PEER,
    DownReason,
    Heartbeat,
    Leave,
    PeerUp,
    PeerDown,
    PeerEvent,
)
from deepinfer.transport.protocol.bulk import (  # noqa: F401
    BufferSpec,
    CmaSource,
    BulkBegin,
    BulkChunk,
    BulkAbort,
    BulkAck,
    BulkFrame,
    BulkReply,
)
from deepinfer.transport.protocol.storage import (  # noqa: F401
    FragmentStatus,
    FragmentMeta,
    PutFragments,
    GetFragments,
    TouchFragments,
    StorageStatsRequest,
    HasFragments,
    FragmentIndex,
    RepairHint,
    RepairHintAck,
    RunGc,
    DebugSet,
    PutAck,
    FragmentsReply,
    TouchAck,
    StorageStats,
    GcDone,
    StorageRequest,
    StorageReply,
)
from deepinfer.transport.protocol.pd import (  # noqa: F401
    TOPIC_PD_LOAD,
    TOPIC_KV_EVENTS,
    FailurePolicy,
    HandoffStatus,
    EngineRef,
    PdImage,
    PdDispatch,
    PdKvPush,
    PdKvReady,
    PdAbort,
    PdLeaseRenew,
    PdDispatchReply,
    PdHandoffAck,
    PdDone,
    PdOutput,
    PdFailed,
    PdLoadReport,
    PdStatusRequest,
    PdEngineStatus,
    KvCacheEvents,
    PdCacheSnapshot,
    PdEngineRequest,
    PdEngineReply,
    PdStream,
    PdLoadEvent,
)
from deepinfer.transport.protocol.swa import (  # noqa: F401
    TOPIC_SWA,
    SwaSlotEvents,
    SwaLocate,
    SwaLocation,
    SwaLocations,
    SwaFetch,
    SwaFetchStatus,
    SwaFetchReply,
    SwaSlotHeader,
    SwaEventsAck,
    SwaEvent,
    SwaDirectoryRequest,
    SwaDirectoryReply,
    SwaFetchRequest,
    SwaFetchReplyUnion,
)
from deepinfer.transport.protocol.ep import (  # noqa: F401
    EpGenerate,
    EpAbort,
    EpStop,
    EpRankRequest,
    EpReady,
    EpOutput,
    EpRequestFailed,
    EpRankStats,
    EpRankReply,
)
