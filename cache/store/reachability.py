"""Which storage nodes accept connections right now: one idle probe connection per node.

A ZeroMQ DEALER never says that its peer is gone: a request to a dead node sits in the socket
until the caller's deadline. So the store client keeps, next to each node's request socket, a
probe DEALER to the same address and listens to libzmq's monitor events on it:

    handshake succeeded ───────────────────────────────> reachable
    disconnected / connect refused (retried) / failed ─> unreachable   (on_lost(node) fires)
    no event yet (just started) ───────────────────────> reachable     (optimistic: ask it)

A killed process's kernel refuses the connection at once, so a crash is seen within
milliseconds; a hung host is found by ZMTP heartbeats (``heartbeat_s``, dead after 3 missed) and a
silent one by the connect timeout. libzmq reconnects by itself every ``reconnect_s``; the first
handshake after a restart makes the node reachable again (on_back(node) fires).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from deepinfer.transport.security import CurveClientKeys, CurveKeyPair, apply_curve
from deepinfer.transport.sockets import default_context

log = logging.getLogger(__name__)

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)
_LOST = {
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_CONNECT_RETRIED: "refused the connection",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the handshake",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the handshake (protocol)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused our CURVE key",
}


class Reachability:
    def __init__(
        self,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: CurveKeyPair | None = None,
        on_lost: Callable[[str], None] = lambda node: None,
        on_back: Callable[[str], None] = lambda node: None,
        heartbeat_s: float = 1.0,
        reconnect_s: float = 0.1,
        connect_timeout_s: float = 2.0,
    ):
        self._ctx = ctx or default_context()
        self._curve = curve
        self._on_lost = on_lost
        self._on_back = on_back
        self._heartbeat_ms = int(heartbeat_s * 1000)
        self._reconnect_ms = int(reconnect_s * 1000)
        self._connect_timeout_ms = int(connect_timeout_s * 1000)
        self.unreachable: dict[str, str] = {}  # node -> why ("refused the connection", ...)
        self._node2probe: dict[str, tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, asyncio.Task]] = {}

    def watch(self, node2address: Mapping[str, str], node2public: Mapping[str, bytes] | None = None) -> None:
        """Probe these nodes (call inside the running loop); nodes already watched are kept."""
        for node, address in node2address.items():
            if node not in self._node2probe:
                self._open(node, address, (node2public or {}).get(node))

    def _open(self, node: str, address: str, server_public: bytes | None) -> None:
        probe = self._ctx.socket(zmq.DEALER)
        probe.linger = 0
        if self._curve is not None and server_public:
            apply_curve(probe, CurveClientKeys(self._curve, server_public))
        probe.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ms)
        probe.setsockopt(zmq.RECONNECT_IVL_MAX, 0)  # no back-off: a restarted node is seen within one interval
        probe.setsockopt(zmq.CONNECT_TIMEOUT, self._connect_timeout_ms)
        probe.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        probe.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
        monitor = probe.get_monitor_socket(_EVENTS)
        probe.connect(address)
        task = asyncio.create_task(self._follow(node, monitor), name=f"reachability-{node}")
        self._node2probe[node] = (probe, monitor, task)

    async def _follow(self, node: str, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.unreachable.pop(node, None) is not None:
                    log.info("storage node %s is reachable again", node)
                    self._on_back(node)
            elif event in _LOST and node not in self.unreachable:
                self.unreachable[node] = _LOST[event]
                log.info("storage node %s %s", node, _LOST[event])
                self._on_lost(node)

    def is_reachable(self, node: str) -> bool:
        return node not in self.unreachable

    def forget(self, node: str) -> None:
        """Stop probing ``node`` (left the membership)."""
        entry = self._node2probe.pop(node, None)
        self.unreachable.pop(node, None)
        if entry is not None:
            probe, monitor, task = entry
            task.cancel()
            probe.disable_monitor()
            monitor.close(linger=0)
            probe.close(linger=0)

    async def close(self) -> None:
        tasks = [entry[2] for entry in self._node2probe.values()]
        for node in list(self._node2probe):
            self.forget(node)
        await asyncio.gather(*tasks, return_exceptions=True)
