"""Node control (ROUTER/DEALER) and peer events (PUB/SUB) messages.

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

import enum

from deepinfer.transport.protocol.common import ErrorReply, PROTOCOL_VERSION, Role, _HotMessage, _Message


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
    EXITED = 4  # its local supervisor saw the process exit


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
