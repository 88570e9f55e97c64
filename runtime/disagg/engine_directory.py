"""The gateway's picture of the disaggregated engines: liveness, instance, load, caches, RPC client.

Fed by the engines' events sockets (heartbeats, ``PdLoadReport``, ``KvCacheEvents`` into the
``CacheView``: prefix index + store presence; a view found behind asks the engine RPC for a
``PdCacheSnapshot``, at most one in flight per engine and one per ``SNAPSHOT_INTERVAL_S``), judged by the pure
``PeerTable`` (runtime/peer_table.py; a silent engine is probed on its node control channel
before it is declared down, runtime/peer_monitor.py), and handed to the balancers as load snapshots
(runtime/balance: ``PrefillLoadView`` / ``DecodeLoadView``). Engines are numbered in config
order (the balancers want small ints); the number stays with the node name across restarts,
the *instance id* is what identifies one life.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.runtime.balance import DecodeLoad, DecodeLoadView, PrefillLoad, PrefillLoadView
from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole
from deepinfer.runtime.disagg.cache_view import CacheView
from deepinfer.runtime.peer_monitor import PeerMonitor
from deepinfer.runtime.peer_table import PeerEventMsg, PeerTable
from deepinfer.transport.channels import EventSubscriber, RequestClient
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import (
    TOPIC_HEARTBEAT,
    TOPIC_KV_EVENTS,
    TOPIC_PD_LOAD,
    EngineRef,
    Heartbeat,
    KvCacheEvents,
    Leave,
    PdCacheSnapshot,
    PdEngineReply,
    PdLoadReport,
    PeerDown,
    PeerEvent,
    PeerUp,
)

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.5  # between two snapshot requests to one engine
SNAPSHOT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class EngineEntry:
    name: str
    role: NodeRole
    engine_id: int
    engine_address: str
    data_address: str
    events_address: str
    rpc: RequestClient
    instance_id: int = 0  # 0: not seen yet
    is_up: bool = False
    is_draining: bool = False
    building: str = ""
    snapshot_at: float = float("-inf")  # when a cache snapshot was last asked for
    snapshot_task: asyncio.Task | None = None

    def ref(self) -> EngineRef:
        return EngineRef(self.name, self.instance_id, self.engine_address, self.data_address)


class EngineDirectory:
    def __init__(self, cluster: ClusterConfig, *, ctx=None, name: str = "gateway",
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self._clock = clock
        self.monitor = PeerMonitor(PeerTable(cluster.cluster.detector), name=name, on_events=self._emit_events,
                                   ctx=ctx, clock=clock)
        self.table = self.monitor.table
        self.prefill_view = PrefillLoadView()
        self.decode_view = DecodeLoadView()
        self.cache = CacheView()
        self.engines: dict[str, EngineEntry] = {}
        self._listeners: list[Callable[[PeerEventMsg], None]] = []
        self._changed = asyncio.Event()
        next_id = {NodeRole.PREFILL: 0, NodeRole.DECODE: 0}
        for spec in cluster.nodes:
            if spec.role in next_id and spec.engine:
                rpc = RequestClient(spec.engine, PdEngineReply, ctx=ctx, name=f"{name}-to-{spec.name}")
                self.engines[spec.name] = EngineEntry(spec.name, spec.role, next_id[spec.role], spec.engine,
                                                      spec.data, spec.events, rpc, building=spec.building)
                next_id[spec.role] += 1
                self.monitor.add_peer(spec.name, spec.control)
        self._subscriber = EventSubscriber(PeerEvent | PdLoadReport | KvCacheEvents,
                                           topics=[TOPIC_HEARTBEAT, TOPIC_PD_LOAD, TOPIC_KV_EVENTS],
                                           ctx=ctx, name=f"{name}-engine-events")
        self._tasks: list[asyncio.Task] = []

    def add_listener(self, listener: Callable[[PeerEventMsg], None]) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        await self._subscriber.start()
        for entry in self.engines.values():
            await entry.rpc.start()
            self._subscriber.connect(entry.events_address)
        self._tasks = [asyncio.create_task(self._listen(), name=f"{self.name}-engine-events")]
        await self.monitor.start()

    async def close(self) -> None:
        for entry in self.engines.values():
            if entry.snapshot_task is not None:
                entry.snapshot_task.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.monitor.close()
        await self._subscriber.close()
        for entry in self.engines.values():
            await entry.rpc.close()

    def up(self, role: NodeRole) -> list[EngineEntry]:
        return [e for e in self.engines.values() if e.role == role and e.is_up and not e.is_draining]

    async def wait_changed(self, timeout_s: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    async def wait_for_candidates(self, exclude: set[str], deadline: float
                                  ) -> tuple[list[PrefillLoad], list[DecodeLoad], float] | str:
        """The up engines' loads to route over, outside ``exclude`` when any are (else every up
        engine): ``(prefill loads, decode loads, now)`` once both roles have one, waiting for
        changes until ``deadline`` (loop time); past it the missing role, "prefill" or "decode"."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            prefill = self.prefill_loads(now, exclude) or self.prefill_loads(now, set())
            decode = self.decode_loads(exclude) or self.decode_loads(set())
            if prefill and decode:
                return prefill, decode, now
            if now >= deadline:
                return "prefill" if not prefill else "decode"
            await self.wait_changed(min(0.2, deadline - now))

    def prefill_loads(self, now: float, exclude: set[str]) -> list[PrefillLoad]:
        ids = {e.engine_id for e in self.up(NodeRole.PREFILL) if e.name not in exclude}
        return [load for load in self.prefill_view.loads(now) if load.engine_id in ids]

    def decode_loads(self, exclude: set[str]) -> list[DecodeLoad]:
        ids = {e.engine_id for e in self.up(NodeRole.DECODE) if e.name not in exclude}
        return [load for load in self.decode_view.loads() if load.engine_id in ids]

    def by_id(self, role: NodeRole, engine_id: int) -> EngineEntry:
        return next(e for e in self.engines.values() if e.role == role and e.engine_id == engine_id)

    # ---- events -------------------------------------------------------------------------------
    async def _listen(self) -> None:
        async for _, msg in self._subscriber:
            if isinstance(msg, Heartbeat):
                entry = self.engines.get(msg.node_name)
                if entry is not None:
                    entry.is_draining = msg.is_draining
                    await self.monitor.observe(msg)
            elif isinstance(msg, Leave):
                await self.monitor.observe(msg)
            elif isinstance(msg, PdLoadReport):
                self._on_load(msg, self._clock())
            elif isinstance(msg, KvCacheEvents):
                self.cache.on_events(msg)
                self._refresh_stale()

    def _refresh_stale(self) -> None:
        """Ask every engine whose cache view fell behind for a snapshot (rate-limited)."""
        now = self._clock()
        for name in self.cache.stale_engines():
            entry = self.engines.get(name)
            if entry is None or not entry.is_up or now - entry.snapshot_at < SNAPSHOT_INTERVAL_S:
                continue
            if entry.snapshot_task is not None and not entry.snapshot_task.done():
                continue
            entry.snapshot_at = now
            entry.snapshot_task = asyncio.ensure_future(self._snapshot(entry))

    async def _snapshot(self, entry: EngineEntry) -> None:
        try:
            reply = await entry.rpc.request(PdCacheSnapshot(), timeout_s=SNAPSHOT_TIMEOUT_S)
        except TransportError as exc:
            log.debug("%s: cache snapshot of %s failed: %s", self.name, entry.name, exc)
            return
        if isinstance(reply, KvCacheEvents):
            self.cache.on_events(reply)

    def process_exited(self, name: str) -> None:
        """``name``'s process exited (its local supervisor saw it): its instance is down now, with
        no probe to wait out, so a restart is never mistaken for the old instance still up."""
        self._emit(self.table.exited(name))

    async def _emit_events(self, events: list[PeerEventMsg]) -> None:
        self._emit(events)

    def _on_load(self, report: PdLoadReport, now: float) -> None:
        entry = self.engines.get(report.node_name)
        if entry is None or not entry.is_up or report.instance_id != entry.instance_id:
            return  # a load report of an instance the heartbeats have not confirmed (or retired)
        self.cache.on_load_seq(entry.name, report.instance_id, report.kv_events_seq)
        self._refresh_stale()
        if entry.role == NodeRole.PREFILL:
            self.prefill_view.on_report(now, PrefillLoad(entry.engine_id, report.num_requests, report.backlog_s))
        else:
            self.decode_view.on_report(now, DecodeLoad(entry.engine_id, report.num_requests, report.num_kv_tokens,
                                                       max(report.max_requests, 1), max(report.kv_capacity_tokens, 1)))
        if entry.is_draining != report.is_draining:
            entry.is_draining = report.is_draining
        self._changed.set()

    def _emit(self, events: list[PeerEventMsg]) -> None:
        for event in events:
            entry = self.engines.get(event.node_name)
            if entry is None:
                continue
            if isinstance(event, PeerUp):
                entry.instance_id, entry.is_up = event.instance_id, True
                self.cache.engine_up(entry.name, event.instance_id,
                                     index_id=entry.engine_id if entry.role == NodeRole.PREFILL else None)
                log.info("%s: %s engine %s up (instance %x)", self.name, entry.role.value, entry.name, event.instance_id)
            elif isinstance(event, PeerDown) and event.instance_id == entry.instance_id:
                entry.is_up = False
                (self.prefill_view if entry.role == NodeRole.PREFILL else self.decode_view).drop_engine(entry.engine_id)
                self.cache.engine_down(entry.name)
                log.warning("%s: %s engine %s down (%s)", self.name, entry.role.value, entry.name, event.reason.name)
            self._changed.set()
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("%s: engine listener failed on %s", self.name, event)
