"""Which node holds the SWA slot for a prefix hash: a pure index plus its asyncio service.

Slots never leave the machine that produced them (ARCHITECTURE.md, "Caches"); this directory is how another
prefill engine finds one. Owners publish ``SwaSlotEvents`` (saved / evicted keys, and now and
then their full set) on their event socket under ``TOPIC_SWA`` (the directory subscribes to
every owner) or send them as requests to the directory (owners whose event socket it does not
know: standalone engines given only the directory's address); it answers ``SwaLocate`` queries,
and drops all entries of a node instance on ``PeerDown`` (its host memory is gone with it), or,
without heartbeats, once the node has been silent past a TTL. Events of an instance already
declared down are ignored, so a late message cannot resurrect a dead node's slots.

    key2nodes:  prefix hash -> {node name: boundary position}      (several nodes may hold one)
    node2keys:  node name   -> {prefix hash}                        (for PeerDown and full sets)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import zmq.asyncio

from deepinfer.cache.block_hash import BlockHash
from deepinfer.transport.channels import EventSubscriber, Incoming, RequestServer
from deepinfer.transport.protocol import (
    TOPIC_SWA,
    PeerDown,
    PeerUp,
    SwaDirectoryRequest,
    SwaEvent,
    SwaEventsAck,
    SwaLocate,
    SwaLocation,
    SwaLocations,
    SwaSlotEvents,
)

log = logging.getLogger(__name__)

_MAX_DEAD_INSTANCES = 1024


@dataclass(slots=True)
class _Node:
    instance_id: int
    fetch_address: str
    keys: set[BlockHash]
    last_seen: float = 0.0  # monotonic time of its last message


class SwaDirectory:
    """Pure index; every method is O(keys touched)."""

    def __init__(self) -> None:
        self._key2nodes: dict[BlockHash, dict[str, int]] = {}
        self._nodes: dict[str, _Node] = {}
        self._dead: OrderedDict[int, None] = OrderedDict()  # instance ids declared down

    @property
    def num_keys(self) -> int:
        return len(self._key2nodes)

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def apply(self, ev: SwaSlotEvents, now: float | None = None) -> None:
        if ev.instance_id in self._dead:
            return
        if len(ev.saved) != len(ev.saved_num_tokens):
            raise ValueError(f"SwaSlotEvents from {ev.node_name}: {len(ev.saved)} keys but "
                             f"{len(ev.saved_num_tokens)} boundaries")
        node = self._nodes.get(ev.node_name)
        if node is not None and node.instance_id != ev.instance_id:
            self._drop(ev.node_name)  # the node restarted: its earlier slots are gone
            node = None
        if node is None:
            node = self._nodes[ev.node_name] = _Node(ev.instance_id, ev.fetch_address, set())
        node.fetch_address = ev.fetch_address
        node.last_seen = time.monotonic() if now is None else now
        if ev.is_full:
            for key in node.keys - set(ev.saved):
                self._unlink(ev.node_name, key)
        for key in ev.evicted:
            self._unlink(ev.node_name, key)
        for key, num_tokens in zip(ev.saved, ev.saved_num_tokens):
            self._key2nodes.setdefault(key, {})[ev.node_name] = num_tokens
            node.keys.add(key)

    def on_peer_event(self, ev: PeerUp | PeerDown) -> None:
        """Heartbeat listener: a node that went down takes its slots with it."""
        if not isinstance(ev, PeerDown):
            return
        self._dead[ev.instance_id] = None
        while len(self._dead) > _MAX_DEAD_INSTANCES:
            self._dead.popitem(last=False)
        node = self._nodes.get(ev.node_name)
        if node is not None and node.instance_id == ev.instance_id:
            self._drop(ev.node_name)

    def num_keys_of(self, node_name: str) -> int:
        node = self._nodes.get(node_name)
        return len(node.keys) if node is not None else 0

    def drop_silent(self, now: float, max_age_s: float) -> list[str]:
        """Drop nodes not heard from for ``max_age_s`` (owners send their full set periodically,
        so only a dead or cut-off one goes silent): the PeerDown of deployments without
        heartbeats. Returns their names."""
        silent = [name for name, node in self._nodes.items() if now - node.last_seen > max_age_s]
        for name in silent:
            self._drop(name)
        return silent

    def drop_node(self, node_name: str) -> int:
        """Forget every slot of ``node_name``; returns how many."""
        return self._drop(node_name)

    def locate(self, key: BlockHash, *, exclude: str = "") -> SwaLocation | None:
        holders = self._key2nodes.get(key)
        if not holders:
            return None
        for name, num_tokens in holders.items():
            if name != exclude:
                return SwaLocation(name, self._nodes[name].fetch_address, num_tokens)
        return None

    def locate_many(self, keys: Sequence[BlockHash]) -> list[SwaLocation | None]:
        return [self.locate(k) for k in keys]

    def _drop(self, node_name: str) -> int:
        node = self._nodes.pop(node_name, None)
        if node is None:
            return 0
        for key in node.keys:
            holders = self._key2nodes.get(key)
            if holders is not None:
                holders.pop(node_name, None)
                if not holders:
                    del self._key2nodes[key]
        return len(node.keys)

    def _unlink(self, node_name: str, key: BlockHash) -> None:
        holders = self._key2nodes.get(key)
        if holders is not None and holders.pop(node_name, None) is not None and not holders:
            del self._key2nodes[key]
        self._nodes[node_name].keys.discard(key)

    def check_integrity(self) -> None:
        for key, holders in self._key2nodes.items():
            assert holders, f"key {key.hex()} has an empty holder set"
            for name in holders:
                assert key in self._nodes[name].keys, f"{name} holds {key.hex()} but does not list it"
        for name, node in self._nodes.items():
            for key in node.keys:
                assert name in self._key2nodes.get(key, {}), f"{name} lists {key.hex()} that is not indexed"


class SwaDirectoryService:
    """The directory on the wire: subscribes to owners' events, answers ``SwaLocate``.

    Runs in the gateway by default (or alone); ``connect_owner(events_address)`` per slot
    owner that publishes (owners may instead send their events as requests); register
    ``directory.on_peer_event`` as a heartbeat listener for PeerDown. Without heartbeats,
    ``node_ttl_s`` drops owners silent for that long (set it above their resync interval)."""

    def __init__(self, address: str, *, ctx: zmq.asyncio.Context | None = None,
                 directory: SwaDirectory | None = None, name: str = "swa-directory",
                 node_ttl_s: float | None = None) -> None:
        if node_ttl_s is not None and not node_ttl_s > 0:
            raise ValueError(f"node_ttl_s must be > 0 seconds or None, got {node_ttl_s!r}")
        self.directory = directory or SwaDirectory()
        self.name = name
        self._server = RequestServer(address, SwaDirectoryRequest, self._handle, ctx=ctx, name=name)
        self._events = EventSubscriber(SwaEvent, topics=[TOPIC_SWA], ctx=ctx, name=f"{name}-events")
        self._node_ttl_s = node_ttl_s
        self._task: asyncio.Task | None = None
        self._expire_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self._server.address

    async def start(self) -> str:
        await self._events.start()
        address = await self._server.start()
        self._task = asyncio.create_task(self._event_loop(), name=f"{self.name}-events")
        if self._node_ttl_s is not None:
            self._expire_task = asyncio.create_task(self._expire_loop(self._node_ttl_s), name=f"{self.name}-expire")
        return address

    async def _expire_loop(self, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 4)
            for name in self.directory.drop_silent(time.monotonic(), ttl_s):
                log.warning("%s: no slot events from %s for %.1f s: dropped its slots", self.name, name, ttl_s)

    def connect_owner(self, events_address: str) -> None:
        self._events.connect(events_address)

    async def _event_loop(self) -> None:
        async for _topic, ev in self._events:
            try:
                self.directory.apply(ev)
            except ValueError as exc:
                log.warning("%s: dropped a bad slot event: %s", self.name, exc)

    async def _handle(self, incoming: Incoming) -> SwaLocations | SwaEventsAck:
        msg = incoming.msg
        if isinstance(msg, SwaSlotEvents):  # an owner that pushes its events (no subscription)
            self.directory.apply(msg)  # a bad message: ValueError -> the owner gets an ErrorReply
            return SwaEventsAck(self.directory.num_keys_of(msg.node_name))
        assert isinstance(msg, SwaLocate)
        return SwaLocations(self.directory.locate_many(msg.keys))

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._expire_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.close()
        await self._events.close()
