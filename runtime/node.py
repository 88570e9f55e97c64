"""The node daemon: one process of a cluster, in one role.

    node = Node(NodeSettings.from_cluster(config, "prefill-0"), roles=[my_role])
    await node.start()              # control channel, events/heartbeats, then each role
    node.install_signal_handlers()  # SIGTERM/SIGINT -> graceful drain, a second one -> stop now
    await node.wait_stopped()

A role is any object with three coroutines (``Role`` below): ``start(node)`` opens its own
channels (a ``RequestServer``, a ``BulkReceiver``, ...), ``drain(deadline_s)`` stops accepting
new work and finishes (or aborts) in-flight work before the deadline, ``stop()`` closes.

Lifecycle: NEW -> RUNNING -> DRAINING -> STOPPED. ``drain()`` marks the node draining (peers
see ``is_draining`` in its next heartbeat, sent at once), drains every role concurrently within
the deadline, then stops: roles in reverse order, heartbeats (with a ``Leave`` so peers mark us
down at once), control channel, events socket. Every socket is closed with linger 0.

With ``NodeSettings.metrics`` (``http://HOST:PORT``, the cluster file's ``metrics`` key) the
node serves its Prometheus registry (its own gauges and whatever its roles registered: KV tier,
store and handoff counters) on ``GET /metrics`` there, from start until stop.

The node's control channel (ROUTER) answers ``Hello`` (-> ``Welcome`` with our instance id),
``StatusRequest`` (-> ``NodeStatus``) and ``Drain`` (-> ``DrainAck``, then drains and stops).
``instance_id`` is random per Node, so a restarted daemon is a new instance to its peers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq.asyncio

from deepinfer.runtime.cluster_config import ClusterConfig
from deepinfer.runtime.failure_detector import (
    DEFAULT_MAX_SILENCE_S,
    DEFAULT_MIN_SILENCE_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_SUSPECT_PHI,
    DetectorSettings,
    detector_settings,
)
from deepinfer.runtime.heartbeat import HeartbeatService, PeerAddress, PeerListener
from deepinfer.runtime.metrics import MetricsRegistry
from deepinfer.transport import security
from deepinfer.transport.channels import EventPublisher, Incoming, RequestServer
from deepinfer.transport.protocol import (
    PROTOCOL_VERSION,
    Drain,
    DrainAck,
    Hello,
    NodeControlRequest,
    NodeStatus,
    StatusRequest,
    Welcome,
)
from deepinfer.transport.protocol import (
    Role as WireRole,
)

log = logging.getLogger(__name__)


class Role(Protocol):
    """What a role plugs into a Node."""

    async def start(self, node: "Node") -> None: ...

    async def drain(self, deadline_s: float) -> None: ...

    async def stop(self) -> None: ...


class NodeState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """The slice of the cluster config one node needs (build it directly in tests)."""

    name: str
    role: WireRole
    control: str
    events: str
    peers: tuple[PeerAddress, ...] = ()
    heartbeat_interval_s: float = 0.5
    missed_beats: int = 3  # with min_silence_s: the floor of suspicion (runtime/failure_detector.py)
    min_silence_s: float = DEFAULT_MIN_SILENCE_S
    suspect_phi: float = DEFAULT_SUSPECT_PHI
    max_silence_s: float = DEFAULT_MAX_SILENCE_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    drain_deadline_s: float = 30.0
    curve_keypair: security.CurveKeyPair | None = None  # set: every socket of the node uses CURVE
    allowed_client_keys: tuple[bytes, ...] = ()  # with curve: peers' + operators' public keys
    metrics: str = ""  # http://HOST:PORT for GET /metrics ("" = not served)

    @classmethod
    def from_cluster(cls, config: ClusterConfig, name: str) -> "NodeSettings":
        spec = config.node(name)
        keypair = None
        if config.security.curve:
            if not spec.curve_secret_key_file:
                raise ValueError(f"node {name}: security.curve is on but curve_secret_key_file is not set")
            keypair = security.load_keypair(spec.curve_secret_key_file)
        peers = tuple(PeerAddress(p.name, p.events, p.curve_public_key.encode() if keypair else None, p.control)
                      for p in config.peers_of(name))
        allowed = tuple(n.curve_public_key.encode() for n in config.nodes) + tuple(
            k.encode() for k in config.security.allow_clients)
        c = config.cluster
        return cls(name=name, role=spec.role.wire, control=spec.control, events=spec.events, peers=peers,
                   heartbeat_interval_s=c.heartbeat_interval_s, missed_beats=c.missed_beats,
                   min_silence_s=c.min_silence_s, suspect_phi=c.suspect_phi, max_silence_s=c.max_silence_s,
                   probe_timeout_s=c.probe_timeout_s, drain_deadline_s=c.drain_deadline_s, curve_keypair=keypair,
                   allowed_client_keys=allowed if keypair else (), metrics=spec.metrics)

    @property
    def detector(self) -> DetectorSettings:
        return detector_settings(interval_s=self.heartbeat_interval_s, missed_beats=self.missed_beats,
                                 suspect_phi=self.suspect_phi, min_silence_s=self.min_silence_s,
                                 max_silence_s=self.max_silence_s, probe_timeout_s=self.probe_timeout_s)


class Node:
    def __init__(self, settings: NodeSettings, roles: Sequence[Role] = (), *, ctx: zmq.asyncio.Context | None = None,
                 metrics: MetricsRegistry | None = None):
        self.settings = settings
        self.name = settings.name
        self.instance_id = secrets.randbits(63)
        self.roles = list(roles)
        self.state = NodeState.NEW
        self.metrics = metrics or MetricsRegistry()
        self.ctx = ctx or zmq.asyncio.Context.instance()
        server_curve = security.CurveServerKeys(settings.curve_keypair) if settings.curve_keypair else None
        self.control = RequestServer(settings.control, NodeControlRequest, self._handle_control, ctx=self.ctx,
                                     curve=server_curve, name=f"{self.name}-control")
        self.events = EventPublisher(settings.events, ctx=self.ctx, curve=server_curve, name=f"{self.name}-events")
        self.heartbeat = HeartbeatService(
            name=self.name, role=settings.role, instance_id=self.instance_id, publisher=self.events,
            peers=settings.peers, detector=settings.detector, ctx=self.ctx, curve_keypair=settings.curve_keypair)
        self._allow_list = (security.ClientAllowList(self.ctx, settings.allowed_client_keys)
                            if settings.curve_keypair else None)
        self._started_roles: list[Role] = []
        self._metrics_runner = None  # aiohttp runner of GET /metrics
        self._started_at = 0.0
        self._stopped = asyncio.Event()
        self._has_start_begun = False
        self._start_done = asyncio.Event()  # start() returned (or failed): a drain may proceed
        self._drain_task: asyncio.Task | None = None
        self._signal_count = 0
        self.metrics.gauge_function("node_peers_up", "Peers currently up", lambda: len(self.heartbeat.table.peers_up()))
        self.metrics.track_channel(f"{self.name}-control", self.control.stats)

    @property
    def is_draining(self) -> bool:
        return self.state is NodeState.DRAINING

    def add_peer_listener(self, listener: PeerListener) -> None:
        self.heartbeat.add_listener(listener)

    async def start(self) -> None:
        assert self.state is NodeState.NEW and not self._has_start_begun, f"node {self.name} already {self.state.value}"
        self._has_start_begun = True
        self._started_at = time.monotonic()
        try:
            if self._allow_list is not None:
                await self._allow_list.start()
            await self.control.start()
            await self.events.start()
            await self.heartbeat.start()
            if self.settings.metrics:
                await self._serve_metrics(self.settings.metrics)
            for role in self.roles:
                await role.start(self)
                self._started_roles.append(role)
        except BaseException:
            await self._close(say_goodbye=False)
            self._start_done.set()
            raise
        self.state = NodeState.RUNNING
        self._start_done.set()
        log.info("node %s (%s, instance %x) running: control %s, events %s", self.name,
                 self.settings.role.name.lower(), self.instance_id, self.control.address, self.events.address)

    async def drain(self, deadline_s: float | None = None) -> None:
        """Stop accepting, let in-flight work finish within the deadline, then stop. Idempotent."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_and_stop(deadline_s), name=f"{self.name}-drain")
        await asyncio.shield(self._drain_task)

    async def _drain_and_stop(self, deadline_s: float | None) -> None:
        deadline_s = self.settings.drain_deadline_s if deadline_s is None else deadline_s
        if self._has_start_begun:
            await self._start_done.wait()  # a signal during start drains once everything is up
        if self.state is NodeState.RUNNING:
            self.state = NodeState.DRAINING
            self.heartbeat.is_draining = True
            await self.heartbeat.beat_now()
            log.info("node %s draining (deadline %gs)", self.name, deadline_s)
            results = await asyncio.gather(*(asyncio.wait_for(role.drain(deadline_s), deadline_s + 1.0)
                                             for role in self._started_roles), return_exceptions=True)
            for role, result in zip(self._started_roles, results):
                if isinstance(result, BaseException):
                    log.warning("node %s: role %s did not drain cleanly: %r", self.name, type(role).__name__, result)
        await self.stop()

    async def stop(self, *, say_goodbye: bool = True) -> None:
        """Stop now (no draining): roles in reverse order, then the node's own sockets.
        ``say_goodbye=False`` skips the ``Leave`` (peers then detect us by missed beats)."""
        if self.state is NodeState.STOPPED:
            return
        await self._close(say_goodbye=say_goodbye)
        log.info("node %s stopped", self.name)

    async def _close(self, *, say_goodbye: bool) -> None:
        self.state = NodeState.STOPPED
        for role in reversed(self._started_roles):
            try:
                await role.stop()
            except Exception:
                log.exception("node %s: role %s failed to stop", self.name, type(role).__name__)
        self._started_roles.clear()
        await self.heartbeat.stop(say_goodbye=say_goodbye)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        await self.control.close()
        await self.events.close()
        if self._allow_list is not None:
            self._allow_list.stop()
        self._stopped.set()

    async def _serve_metrics(self, address: str) -> None:
        from deepinfer.cache.store.metrics import serve_metrics

        host, _, port = address.removeprefix("http://").rpartition(":")
        self._metrics_runner = await serve_metrics(self.metrics.registry, host, int(port))

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: first one drains gracefully, a second one stops at once.
        Only for processes that own their loop (``deepinfer node``), on the main thread; install
        them before ``start()`` so a signal during start-up still ends in a clean drain."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signal_count += 1
        if self._signal_count == 1:
            log.info("node %s: %s, draining", self.name, sig.name)
            asyncio.ensure_future(self.drain())
        else:
            log.warning("node %s: second %s, stopping now", self.name, sig.name)
            if self._drain_task is not None:
                self._drain_task.cancel()
            asyncio.ensure_future(self.stop_when_started())

    async def stop_when_started(self) -> None:
        """Stop now (no draining), or as soon as a ``start()`` in progress is done."""
        if self._has_start_begun:
            await self._start_done.wait()
        await self.stop()

    async def _handle_control(self, incoming: Incoming):
        msg = incoming.msg
        if isinstance(msg, Hello):
            log.debug("node %s: hello from %s (instance %x)", self.name, msg.node_name, msg.instance_id)
            return Welcome(node_name=self.name, role=self.settings.role, instance_id=self.instance_id,
                           protocol_version=PROTOCOL_VERSION)
        if isinstance(msg, StatusRequest):
            return NodeStatus(node_name=self.name, role=self.settings.role, instance_id=self.instance_id,
                              is_draining=self.is_draining, uptime_s=time.monotonic() - self._started_at,
                              peers_up=self.heartbeat.table.peers_up())
        if isinstance(msg, Drain):
            num_in_flight = sum(getattr(role, "num_in_flight", 0) for role in self._started_roles)
            if self._drain_task is None:
                self._drain_task = asyncio.create_task(self._drain_and_stop(msg.deadline_s), name=f"{self.name}-drain")
            return DrainAck(node_name=self.name, num_in_flight=num_in_flight)
        raise AssertionError(f"unhandled control message {type(msg).__name__}")
