"""What prefill and decode engines share: the engine RPC server, load reports, status, links.

A disaggregated engine is a node role (``runtime.node.Role``) around one ``EngineLoop``:

- engine RPC (``NodeSpec.engine``, ROUTER): ``PdEngineRequest`` in, ``PdEngineReply`` out; the
  subclass answers dispatch / ready / abort / lease messages, this class answers status;
- load reports (``PdLoadReport`` under ``TOPIC_PD_LOAD`` on the node's events socket) every
  ``load_interval_s`` for the gateways' balancers;
- cache events (``KvCacheEvents`` under ``TOPIC_KV_EVENTS``, same socket and period): block
  hashes the prefix cache gained and lost, and those the KV store acknowledged, for the gateways'
  prefix indexes; ``PdCacheSnapshot`` on the engine RPC answers every cached hash at once (a
  gateway that lost events). A decode engine's own cache serves no prefill, so it publishes only
  what it wrote to the store;
- the KV tier and store client counters (``KVTierCollector``) on the node's /metrics;
- links to peer engines (``PeerLinks``): one RPC client and one bulk sender per peer
  *instance*, closed on that instance's PeerDown so nothing is ever sent to a previous life.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer.engine.core.factory import EngineParts
from deepinfer.engine.kv.tier_metrics import KVTierCollector
from deepinfer.runtime.disagg.engine_loop import EngineLoop
from deepinfer.runtime.disagg.handoff_metrics import HandoffMetrics
from deepinfer.transport.channels import Incoming, RequestClient, RequestServer
from deepinfer.transport.dataplane import BulkSender
from deepinfer.transport.errors import TransportError, UnexpectedMessage
from deepinfer.transport.protocol import (
    TOPIC_KV_EVENTS,
    TOPIC_PD_LOAD,
    EngineRef,
    ErrorCode,
    KvCacheEvents,
    PdCacheSnapshot,
    PdEngineReply,
    PdEngineRequest,
    PdEngineStatus,
    PdLoadReport,
    PdStatusRequest,
    PeerDown,
)
from deepinfer.transport.protocol import (
    Role as WireRole,
)

log = logging.getLogger(__name__)


class StaleInstance(TransportError):
    """A message addressed to another instance of this engine (a previous or later life)."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class EngineServiceConfig:
    engine_address: str  # this engine's RPC ROUTER
    data_address: str = ""  # decode: the bulk receiver
    lease_s: float = 5.0  # prefill-held KV without a renewal or ack is freed after this
    handoff_timeout_s: float = 30.0  # push + import + ack, at most
    load_interval_s: float = 0.1
    default_deadline_s: float = 120.0  # a dispatch without a deadline
    # prefill: the SWA slot directory (in the gateway) this engine shares its slot store through
    swa_directory: str = ""
    swa_peer_host: str = "127.0.0.1"  # where other engines reach this one's slot sockets
    # a pipelined engine's GIL switch interval (EngineOptions.switch_interval_s; None: leave it)
    switch_interval_s: float | None = 0.0005


class PeerLinks:
    """RPC clients and bulk senders to peer engine instances, keyed by (name, instance id)."""

    def __init__(self, ctx, name: str):
        self._ctx = ctx
        self._name = name
        self._rpc: dict[tuple[str, int], RequestClient] = {}
        self._bulk: dict[tuple[str, int], BulkSender] = {}

    async def rpc(self, ref: EngineRef) -> RequestClient:
        key = (ref.node_name, ref.instance_id)
        client = self._rpc.get(key)
        if client is None:
            client = RequestClient(ref.engine_address, PdEngineReply, ctx=self._ctx,
                                   name=f"{self._name}-to-{ref.node_name}")
            await client.start()
            self._rpc[key] = client
        return client

    async def bulk(self, ref: EngineRef) -> BulkSender:
        key = (ref.node_name, ref.instance_id)
        sender = self._bulk.get(key)
        if sender is None:
            sender = BulkSender(ref.data_address, ctx=self._ctx, name=f"{self._name}-kv-to-{ref.node_name}")
            await sender.start()
            self._bulk[key] = sender
        return sender

    async def drop(self, node_name: str, instance_id: int) -> None:
        key = (node_name, instance_id)
        for table in (self._rpc, self._bulk):
            link = table.pop(key, None)
            if link is not None:
                await link.close()

    async def close(self) -> None:
        for table in (self._rpc, self._bulk):
            links = list(table.values())
            table.clear()
            for link in links:
                await link.close()


class DisaggEngineService:
    """Base of PrefillService / DecodeService (runtime/disagg/prefill.py, decode.py)."""

    wire_role: WireRole
    # step overlap (engine_loop.py): a decode pipelines; a prefill keeps commit -> export adjacent
    is_pipelined: bool = False
    # whether its prefix cache's blocks go into the gateways' prefix indexes (prefill engines)
    publishes_cache: bool = True

    def __init__(self, parts: EngineParts, config: EngineServiceConfig):
        self.parts = parts
        self.core = parts.core
        self.config = config
        self.metrics = HandoffMetrics()
        self.node = None
        self.node_name = ""
        self.instance_id = 0
        self.loop: EngineLoop | None = None
        self.server: RequestServer | None = None
        self.links: PeerLinks | None = None
        self._tasks: list[asyncio.Task] = []
        self.is_draining = False
        self.num_kv_events = 0  # KvCacheEvents published (their seq)

    # ---- Role ---------------------------------------------------------------------------------
    async def start(self, node) -> None:
        self.node, self.node_name, self.instance_id = node, node.name, node.instance_id
        self.metrics = HandoffMetrics(node.metrics)
        on_scheduled = None if self.is_pipelined else self._on_scheduled
        self.loop = EngineLoop(self.core, on_scheduled=on_scheduled, name=node.name, is_pipelined=self.is_pipelined,
                               switch_interval_s=self.config.switch_interval_s)
        self.loop.start()
        self.links = PeerLinks(node.ctx, node.name)
        self.server = RequestServer(self.config.engine_address, PdEngineRequest, self._handle, ctx=node.ctx,
                                    name=f"{node.name}-engine")
        await self.server.start()
        node.metrics.track_channel(f"{node.name}-engine", self.server.stats)
        if self.parts.kv_offload is not None:
            node.metrics.registry.register(KVTierCollector(self.parts.kv_offload, node.name))
        node.metrics.gauge_function("kv_cached_blocks", "Blocks in the prefix cache (device)",
                                    lambda: self.core.scheduler.pool.num_cached_blocks)
        node.metrics.gauge_function("kv_events_published", "Cache event messages published", lambda: self.num_kv_events)
        node.add_peer_listener(self._on_peer_event)
        await self._start_extra()
        self._tasks.append(asyncio.create_task(self._report_load(), name=f"{node.name}-load"))
        log.info("%s engine (%s) serving on %s", node.name, self.wire_role.name.lower(), self.server.address)

    async def drain(self, deadline_s: float) -> None:
        self.is_draining = True
        if self.server is not None:
            await self.server.drain(deadline_s)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._stop_extra()
        if self.server is not None:
            await self.server.close()
        if self.loop is not None:
            await self.loop.stop()
        if self.links is not None:
            await self.links.close()

    @property
    def num_in_flight(self) -> int:
        return self.loop.num_requests if self.loop is not None else 0

    # ---- subclass hooks -----------------------------------------------------------------------
    async def _start_extra(self) -> None: ...

    async def _stop_extra(self) -> None: ...

    def _on_scheduled(self, plan) -> None: ...

    async def _handle_request(self, msg: Any) -> Any:
        raise UnexpectedMessage(f"{type(msg).__name__} is not served by a {self.wire_role.name.lower()} engine")

    def _on_peer_down(self, event: PeerDown) -> None: ...

    def _num_held(self) -> tuple[int, int, int]:
        """(held handoffs, held bytes, pending imports)."""
        return 0, 0, 0

    def _backlog_s(self) -> float:
        return 0.0

    # ---- shared -------------------------------------------------------------------------------
    def check_instance(self, instance_id: int, what: str) -> None:
        if instance_id != self.instance_id:
            raise StaleInstance(f"{what} is for instance {instance_id:x} of {self.node_name}, "
                                f"this is instance {self.instance_id:x} (restarted); route it again")

    async def _handle(self, incoming: Incoming) -> Any:
        msg = incoming.msg
        if isinstance(msg, PdStatusRequest):
            return self.status()
        if isinstance(msg, PdCacheSnapshot):
            return self.cache_snapshot()
        return await self._handle_request(msg)

    def status(self) -> PdEngineStatus:
        held, held_bytes, pending = self._num_held()
        m = self.metrics
        return PdEngineStatus(
            node_name=self.node_name, role=self.wire_role, instance_id=self.instance_id,
            num_requests=self.num_in_flight, num_held_handoffs=held, held_bytes=held_bytes,
            num_pending_imports=pending, num_handoffs=m.num_handoffs, handoff_bytes=m.num_bytes,
            handoff_p50_s=m.latency_p50_s, handoff_p99_s=m.latency_p99_s, handoff_GBps=m.GBps,
            failures=dict(m.failures), swa=asdict(swa.stats) if (swa := self.parts.swa_slots) is not None else {},
            kv=self.kv_counters(), spec=self.spec_counters())

    def spec_counters(self) -> dict[str, int]:
        """DSpark's drafted / verified / accepted counters ({} when the engine does not speculate)."""
        spec = self.core.spec
        if spec is None:
            return {}
        return {k: v for k, v in spec.stats.as_dict().items() if isinstance(v, int)}

    def kv_counters(self) -> dict[str, int]:
        """Prefix cache and KV tier counters (status, ``deepinfer cluster status``)."""
        pool = self.core.scheduler.pool
        out = {"num_cached_blocks": pool.num_cached_blocks, "num_blocks": pool.num_blocks,
               "num_hit_blocks": pool.num_hits, "num_queried_blocks": pool.num_queries}
        if self.parts.kv_offload is not None:
            out.update(asdict(self.parts.kv_offload.stats))
        return out

    # ---- cache events -------------------------------------------------------------------------
    def _events_header(self) -> dict:
        sched = self.core.config.scheduler
        return dict(node_name=self.node_name, instance_id=self.instance_id, model_id=sched.model_id,
                    block_size=sched.block_size)

    def kv_events(self) -> KvCacheEvents | None:
        """What the prefix cache and the store gained and lost since the last call (None: nothing)."""
        from deepinfer.cache.block_pool import BlockStored

        stored, evicted = [], []
        for event in self.core.drain_kv_events():  # always drained: the pool keeps events until then
            (stored if isinstance(event, BlockStored) else evicted).append(event.block_hash)
        if not self.publishes_cache:
            stored, evicted = [], []
        offload = self.parts.kv_offload
        written = offload.drain_store_written() if offload is not None else []
        if not (stored or evicted or written):
            return None
        self.num_kv_events += 1
        return KvCacheEvents(**self._events_header(), seq=self.num_kv_events, stored=stored, evicted=evicted,
                             store_written=written)

    def cache_snapshot(self) -> KvCacheEvents:
        """Every block cached now; events published after it (seq > its seq) apply on top."""
        stored = self.core.scheduler.pool.cached_hashes() if self.publishes_cache else []
        return KvCacheEvents(**self._events_header(), seq=self.num_kv_events, stored=stored, is_snapshot=True)

    def _on_peer_event(self, event) -> None:
        if isinstance(event, PeerDown):
            self._on_peer_down(event)
            if self.links is not None:
                asyncio.ensure_future(self.links.drop(event.node_name, event.instance_id))

    def load_report(self) -> PdLoadReport:
        sched = self.core.scheduler
        num_kv = sum(r.num_tokens for r in sched.requests.values())
        return PdLoadReport(
            node_name=self.node_name, role=self.wire_role, instance_id=self.instance_id,
            num_requests=sched.num_unfinished, num_kv_tokens=num_kv, backlog_s=self._backlog_s(),
            max_requests=sched.config.max_num_seqs,
            kv_capacity_tokens=self.core.config.num_blocks * sched.config.block_size,
            is_draining=self.is_draining, kv_events_seq=self.num_kv_events)

    async def _report_load(self) -> None:
        while True:
            try:
                events = self.kv_events()
                if events is not None:
                    await self.node.events.publish(TOPIC_KV_EVENTS, events)
                await self.node.events.publish(TOPIC_PD_LOAD, self.load_report())
            except Exception as exc:  # the events socket closes during stop
                log.debug("%s: load report not published: %s", self.node_name, exc)
            await asyncio.sleep(self.config.load_interval_s)
