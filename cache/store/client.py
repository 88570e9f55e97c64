"""ClusterStore: the erasure-coded storage cluster behind the ObjectStore interface (api.py).

Write (writes.py): each object -> k data + m parity fragments -> the first k+m usable nodes of
its rendezvous ranking (placement.py), one PutFragments per node for the whole batch; an object
is stored once ``write_quorum`` fragments are durable (default k+1). A write short of k+m is
*degraded*: the nodes holding its fragments are told (RepairHint) and their repair adds the rest.

Read (reads.py, hedged): per object ask the first k+1 usable nodes of its ranking, one
GetFragments per node for the whole batch; decode as soon as k fragments of one write are in.
A key that cannot reach k fragments because nodes are unusable ends at once as UNAVAILABLE naming
them; one not assembled by the deadline is a typed DEADLINE miss.

Membership (membership.py): a node list, or a membership record whose file the store follows
(``membership_file``): nodes join, drain (read after the group, never written to) or leave.

Node health (node_health.py): heartbeats (``on_peer_event``), the membership record's states, and
this client's own probe connection to every node (reachability.py): a node that refuses or drops
connections is skipped from the next request on, and requests already in flight to it end at
once instead of at their deadline. A node that failed a request or straggled is *suspect* for
``suspect_s`` seconds: asked last, as a hedge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio

from deepinfer.cache.store import reads, writes
from deepinfer.cache.store.api import ClientStats, GetResult, PutResult
from deepinfer.cache.store.ec import ECConfig, ErasureCodec
from deepinfer.cache.store.membership import Membership, MembershipFile, NodeState
from deepinfer.cache.store.node import MAX_FRAGMENT_BYTES
from deepinfer.cache.store.node_health import NodeHealth
from deepinfer.cache.store.placement import Placement
from deepinfer.cache.store.reachability import Reachability
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import StorageReply, StorageStats, StorageStatsRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClusterStoreConfig:
    ec: ECConfig = ECConfig()
    read_width: int = 0  # nodes asked first; 0 = k+1
    write_quorum: int = 0  # durable fragments that make a write stored; 0 = k+1
    hedge_delay_s: float = 0.010
    hedge_delay_per_key_s: float = 0.0005
    num_spare_nodes: int = 2  # ranked past k+m: asked on hedges (writes that skipped down nodes)
    suspect_s: float = 2.0
    probe_nodes: bool = True  # keep a probe connection per node (reachability.py)
    send_repair_hints: bool = True  # tell nodes about degraded writes and reads that found fragments missing

    def __post_init__(self) -> None:
        k, n = self.ec.k, self.ec.num_fragments
        if self.read_width and not k <= self.read_width <= n:
            raise ValueError(f"read_width must be in {k}..{n} (k..k+m), got {self.read_width}")
        if self.write_quorum and not min(k + 1, n) <= self.write_quorum <= n:
            raise ValueError(f"write_quorum must be in {min(k + 1, n)}..{n} (k+1..k+m), got {self.write_quorum}")

    @property
    def first_wave(self) -> int:
        return self.read_width or min(self.ec.k + 1, self.ec.num_fragments)

    @property
    def quorum(self) -> int:
        return self.write_quorum or min(self.ec.k + 1, self.ec.num_fragments)


class ClusterStore:
    def __init__(
        self,
        nodes: Mapping[str, str] | Membership,
        config: ClusterStoreConfig = ClusterStoreConfig(),
        *,
        ctx: zmq.asyncio.Context | None = None,
        membership_file: str | Path | None = None,
        membership_poll_s: float = 1.0,
    ):
        """``nodes``: storage node name -> ZeroMQ address (from the cluster config), or a
        membership record (membership.py); with ``membership_file`` the record is re-read when
        the file changes (nodes added, drained, removed)."""
        membership = nodes if isinstance(nodes, Membership) else Membership.of(nodes, k=config.ec.k, m=config.ec.m)
        self.config = config
        self.codec = ErasureCodec(config.ec)
        self.stats = ClientStats()
        self._ctx = ctx
        self._node2client: dict[str, RequestClient] = {}
        self._started: set[str] = set()  # nodes whose request client is started
        self.reachability = Reachability(ctx=ctx, on_lost=self._on_node_lost)
        self.health = NodeHealth((), config.suspect_s, unreachable=self.reachability.unreachable)
        self._node2tasks: dict[str, set[asyncio.Task]] = defaultdict(set)  # requests in flight, per node
        self._background: set[asyncio.Task] = set()
        self._hinted_at: OrderedDict[bytes, float] = OrderedDict()  # repair hints sent lately, per key
        self._is_started = False
        self._membership_file = MembershipFile(membership_file, membership) if membership_file else None
        self._membership_poll_s = membership_poll_s
        self._set_membership(membership)

    def _set_membership(self, membership: Membership) -> None:
        """Use a (new) membership record: ranking, states, one request client per node."""
        names = membership.ranked_names
        if len(names) < self.config.ec.num_fragments:
            raise ValueError(
                f"{len(names)} storage nodes cannot hold a k+m={self.config.ec.num_fragments} coding group; "
                "add nodes or configure a smaller k/m"
            )
        self.membership = membership
        self.placement = Placement(names)
        self.draining = membership.names_in(NodeState.DRAINING)
        self.health.set_nodes(names)
        self.health.excluded = {n: "down" for n in membership.names_in(NodeState.DOWN)}
        for name, address in membership.node2address.items():
            client = self._node2client.get(name)
            if client is not None and client.address != address:  # moved: a fresh socket
                self.background(client.close())
                self._started.discard(name)
                self.reachability.forget(name)
                client = None
            if client is None:
                self._node2client[name] = self._client(name, address)
        for name in set(self._node2client) - set(names):
            self.background(self._node2client.pop(name).close())
            self._started.discard(name)
            self.reachability.forget(name)

    def _client(self, name: str, address: str) -> RequestClient:
        return RequestClient(address, StorageReply, ctx=self._ctx, max_attachment_bytes=MAX_FRAGMENT_BYTES, name=f"store-{name}")

    async def apply_membership(self, membership: Membership) -> None:
        """Switch to ``membership`` (a started store connects to the new nodes at once)."""
        self._set_membership(membership)
        if self._is_started:
            await self._connect_all()

    async def _connect_all(self) -> None:
        for name, client in list(self._node2client.items()):
            if name not in self._started:
                self._started.add(name)
                await client.start()
        if self.config.probe_nodes:
            self.reachability.watch(self.membership.node2address)

    async def _follow_membership_file(self) -> None:
        while True:
            await asyncio.sleep(self._membership_poll_s)
            record = self._membership_file.poll()
            if record is not None and record.epoch >= self.membership.epoch:
                try:
                    await self.apply_membership(record)
                    log.info("store membership epoch %d: %d nodes (%d draining, %d down)", record.epoch,
                             len(record.ranked_names), len(self.draining), len(self.health.excluded))
                except ValueError as exc:
                    log.warning("store membership epoch %d ignored: %s", record.epoch, exc)

    @classmethod
    def from_cluster_config(cls, config, *, ctx: zmq.asyncio.Context | None = None, **options) -> "ClusterStore":
        """The store of a cluster config (runtime.cluster_config.ClusterConfig, duck-typed so that
        cache/ does not import runtime/): every node with role storage, reached at its ``data``
        address; k and m from ``[storage]``; ``options`` override ClusterStoreConfig fields."""
        nodes = {spec.name: spec.data for spec in config.nodes if str(spec.role) == "storage"}
        missing = [name for name, addr in nodes.items() if not addr]
        if missing:
            raise ValueError(f"storage nodes {', '.join(missing)} have no data address (their fragment ROUTER)")
        ec = ECConfig(k=config.storage.ec_k, m=config.storage.ec_m)
        return cls(nodes, ClusterStoreConfig(ec=ec, **options), ctx=ctx)

    async def start(self) -> "ClusterStore":
        await self._connect_all()
        self._is_started = True
        if self._membership_file is not None:
            self.background(self._follow_membership_file())
        return self

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.reachability.close()
        for client in self._node2client.values():
            await client.close()

    async def __aenter__(self) -> "ClusterStore":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- node health (node_health.py) ---------------------------------------------------
    def mark_down(self, node: str) -> None:
        self.health.mark_down(node)

    def mark_up(self, node: str) -> None:
        self.health.mark_up(node)

    def on_peer_event(self, event) -> None:
        """Heartbeat listener for ``Node.add_peer_listener``: PeerDown -> skip, PeerUp -> use again."""
        self.health.on_peer_event(event)

    def is_down(self, node: str) -> bool:
        return node in self.health.unusable()

    async def wait_reachable(self, nodes: Sequence[str], timeout_s: float = 5.0) -> bool:
        """Wait until the probes of ``nodes`` have connected (after a restart: one reconnect
        interval); False if some did not within ``timeout_s``."""
        give_up_at = time.monotonic() + timeout_s
        while any(not self.reachability.is_reachable(n) for n in nodes):
            if time.monotonic() >= give_up_at:
                return False
            await asyncio.sleep(0.01)
        return True

    def _on_node_lost(self, node: str) -> None:
        """Its connection dropped or was refused: end what is in flight to it now, not at the deadline."""
        for task in list(self._node2tasks.get(node, ())):
            task.cancel()

    def track(self, node: str, task: asyncio.Task) -> asyncio.Task:
        """Register a request task to ``node`` so that losing the node cancels it (at once, when
        it was lost while the caller planned the request)."""
        if node in self.reachability.unreachable:
            task.cancel()
            return task
        tasks = self._node2tasks[node]
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def request_task(self, node: str, coro) -> asyncio.Task:
        return self.track(node, asyncio.create_task(coro))

    def note_hint(self, key: bytes, every_s: float = 10.0) -> bool:
        """True when a repair hint for ``key`` is due (not sent in the last ``every_s``): every
        read of a degraded object must not send one."""
        now = time.monotonic()
        if now - self._hinted_at.get(key, -every_s) < every_s:
            return False
        self._hinted_at[key] = now
        self._hinted_at.move_to_end(key)
        while len(self._hinted_at) > 4096:
            self._hinted_at.popitem(last=False)
        return True

    def background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- reads (reads.py) ----------------------------------------------------------------
    async def get_blocks(self, keys: Sequence[bytes], deadline: float) -> list[GetResult]:
        """One result per key, in order; never raises for a missing or late object."""
        return await reads.get_objects(self, keys, deadline)

    async def best_effort(self, node: str, msg) -> None:
        try:
            await self.request_task(node, self._node2client[node].request(msg, timeout_s=1.0))
        except (TransportError, asyncio.CancelledError, KeyError):  # KeyError: left the membership meanwhile
            pass  # best effort: a missed touch or hint only makes that node's LRU or repair later

    # ---- writes (writes.py) ---------------------------------------------------------------
    async def put_blocks(self, items: Sequence[tuple[bytes, object]], *, traffic_class: str, deadline: float) -> list[PutResult]:
        """Store objects; one result each, in order (``is_ok`` once ``quorum`` fragments are durable)."""
        return await writes.put_objects(self, items, traffic_class, deadline)

    # ---- operations -----------------------------------------------------------------------
    def client_of(self, node: str) -> RequestClient:
        return self._node2client[node]

    async def request_node(self, node: str, msg, timeout_s: float = 2.0):
        """Send one control message (stats, RunGc, ...) to one node; raises TransportError."""
        return await self._node2client[node].request(msg, timeout_s=timeout_s)

    async def node_stats(self, timeout_s: float = 2.0) -> dict[str, StorageStats | None]:
        """Each node's stats (None for nodes that did not answer in time)."""

        async def one(name: str) -> StorageStats | None:
            try:
                return await self.request_node(name, StorageStatsRequest(), timeout_s)
            except TransportError:
                return None

        names = sorted(self._node2client)
        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    def address_of(self, node: str) -> str:
        return self._node2client[node].address

    def num_pending_requests(self) -> int:
        return sum(c.num_pending for c in self._node2client.values())
