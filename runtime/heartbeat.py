"""Peer heartbeats over PUB/SUB and the events they turn into.

Every node publishes ``Heartbeat`` on its events socket (topic ``hb``) each ``interval_s`` and
subscribes to every peer's events socket. ``PeerMonitor`` (runtime/peer_monitor.py) judges
them with the pure ``PeerTable``: a silent peer is suspected by the phi-accrual detector
(runtime/failure_detector.py) and probed on its control channel before it is declared down.
Each resulting ``PeerUp``/``PeerDown`` is

- published on our own events socket under topic ``peer`` (remote observers),
- passed to every local listener callback (``add_listener``), and
- put on every queue handed out by ``subscribe()``.

On a graceful stop the service publishes ``Leave`` so peers mark us down at once instead of
waiting for the detector. Detection time for a killed peer: at most
``settings.max_silence_s + settings.probe_timeout_s`` of silence plus half an interval (the
sweep period); about ``min_silence_s + probe_timeout_s`` when its beats were regular.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq.asyncio

from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.runtime.peer_monitor import PeerMonitor
from deepinfer.runtime.peer_table import PeerEventMsg, PeerTable
from deepinfer.transport.channels import EventPublisher, EventSubscriber
from deepinfer.transport.protocol import TOPIC_HEARTBEAT, TOPIC_PEER, Heartbeat, Leave, PeerEvent, PeerUp, Role
from deepinfer.transport.security import CurveKeyPair

log = logging.getLogger(__name__)

PeerListener = Callable[[PeerEventMsg], None]


@dataclass(frozen=True, slots=True)
class PeerAddress:
    name: str
    events: str  # the peer's PUB address
    curve_public_key: bytes | None = None
    control: str = ""  # the peer's node control channel, where suspicions are probed ("": none)


class HeartbeatService:
    def __init__(self, *, name: str, role: Role, instance_id: int, publisher: EventPublisher,
                 peers: Sequence[PeerAddress], detector: DetectorSettings,
                 ctx: zmq.asyncio.Context | None = None, curve_keypair: CurveKeyPair | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.role = role
        self.instance_id = instance_id
        self.interval_s = detector.interval_s
        self.is_draining = False
        self.monitor = PeerMonitor(PeerTable(detector), name=name, on_events=self._emit, ctx=ctx,
                                   curve_keypair=curve_keypair, clock=clock)
        self.table = self.monitor.table
        self._publisher = publisher
        self._peers = list(peers)
        self._subscriber = EventSubscriber(PeerEvent, topics=[TOPIC_HEARTBEAT], ctx=ctx, curve_keypair=curve_keypair,
                                           name=f"{name}-heartbeats")
        self._listeners: list[PeerListener] = []
        self._queues: list[asyncio.Queue[PeerEventMsg]] = []
        self._tasks: list[asyncio.Task] = []
        self._seq = 0

    def add_listener(self, listener: PeerListener) -> None:
        """``listener(event)`` runs on the loop for every PeerUp/PeerDown; keep it quick."""
        self._listeners.append(listener)

    def subscribe(self) -> asyncio.Queue[PeerEventMsg]:
        """A queue that receives every later PeerUp/PeerDown."""
        queue: asyncio.Queue[PeerEventMsg] = asyncio.Queue()
        self._queues.append(queue)
        return queue

    def connect_peer(self, peer: PeerAddress) -> None:
        self._subscriber.connect(peer.events, server_public=peer.curve_public_key)
        self.monitor.add_peer(peer.name, peer.control, peer.curve_public_key)

    async def start(self) -> None:
        await self._subscriber.start()
        for peer in self._peers:
            self.connect_peer(peer)
        self._tasks = [
            asyncio.create_task(self._beat_loop(), name=f"{self.name}-beat"),
            asyncio.create_task(self._listen_loop(), name=f"{self.name}-listen"),
        ]
        await self.monitor.start()

    async def stop(self, *, say_goodbye: bool = True) -> None:
        was_running = bool(self._tasks)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.monitor.close()
        if say_goodbye and was_running:
            try:
                await self._publisher.publish(TOPIC_HEARTBEAT, Leave(node_name=self.name, instance_id=self.instance_id))
            except Exception as exc:  # the publisher may already be gone; peers then use missed beats
                log.debug("%s: Leave not published: %s", self.name, exc)
        await self._subscriber.close()

    async def beat_now(self) -> None:
        """Publish one heartbeat immediately (e.g. to announce draining without waiting)."""
        self._seq += 1
        await self._publisher.publish(TOPIC_HEARTBEAT, Heartbeat(
            node_name=self.name, role=self.role, instance_id=self.instance_id, seq=self._seq,
            is_draining=self.is_draining))

    async def _beat_loop(self) -> None:
        while True:
            await self.beat_now()
            await asyncio.sleep(self.interval_s)

    async def _listen_loop(self) -> None:
        async for _, msg in self._subscriber:
            if isinstance(msg, (Heartbeat, Leave)) and msg.node_name != self.name:
                await self.monitor.observe(msg)

    async def _emit(self, events: list[PeerEventMsg]) -> None:
        for event in events:
            level = logging.INFO if isinstance(event, PeerUp) else logging.WARNING
            log.log(level, "%s: %s", self.name, event)
            await self._publisher.publish(TOPIC_PEER, event)
            for queue in self._queues:
                queue.put_nowait(event)
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("%s: peer listener failed on %s", self.name, event)
