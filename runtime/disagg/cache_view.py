"""A gateway's picture of where prefixes are cached: one prefix index over the prefill engines'
device caches and the KV store's presence, both fed by the engines' cache events.

Engines publish ``KvCacheEvents`` (transport/protocol/pd.py) on their events sockets: hashes their
prefix cache stored and evicted, and hashes the store acknowledged. This view applies them per
engine *instance*, in ``seq`` order:

    seq 1..n applied        seq n+2 arrives (n+1 lost)    -> the engine needs a snapshot
    snapshot (seq s)        replaces the engine's blocks; events with seq > s apply on top
                            (a snapshot older than events already applied is asked again)

A gap, a load report whose ``kv_events_seq`` is ahead of what arrived, or an instance seen for
the first time marks the engine *stale*: the owner (engine_directory.py) asks its engine RPC for
a ``PdCacheSnapshot``. Events of another instance than the one the heartbeats confirmed are
dropped; a PeerDown drops everything the engine held (a restarted engine starts empty).

``block_hashes(prompt)`` hashes a prompt the way the engines do (cache/block_hash.py: their
``model_id`` and ``block_size`` arrive with every message), so the router can match it. No
sockets here: the owner feeds messages and asks for snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash, extend_block_hashes, root_hash
from deepinfer.runtime.balance.prefix_index import PrefixIndex
from deepinfer.runtime.balance.store_presence import StorePresence
from deepinfer.transport.protocol import KvCacheEvents

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _EngineFeed:
    instance_id: int = 0
    index_id: int | None = None  # its id in the prefix index (prefill engines); None: not indexed
    last_seq: int = 0
    is_stale: bool = True  # its blocks here may differ from its cache: a snapshot is due


@dataclass(slots=True)
class CacheViewStats:
    num_events: int = 0  # KvCacheEvents applied
    num_snapshots: int = 0
    num_gaps: int = 0  # times an engine was found behind (lost events)
    num_dropped: int = 0  # messages of an unconfirmed or previous instance


class CacheView:
    def __init__(self, *, max_store_blocks: int = 1 << 20):
        self.index = PrefixIndex()  # prefill engine id -> blocks of its device cache
        self.store = StorePresence(max_store_blocks)
        self.stats = CacheViewStats()
        self.model_id: str | None = None  # None until some engine spoke
        self.block_size = 0
        self._engines: dict[str, _EngineFeed] = {}  # engine node name -> feed

    # ---- the owner's calls --------------------------------------------------------------
    def engine_up(self, name: str, instance_id: int, *, index_id: int | None) -> None:
        """Heartbeats confirmed ``instance_id`` of engine ``name``: a new instance starts empty.
        ``index_id``: its id in the prefix index (prefill engines), None for engines whose own
        cache serves no prefill (decode: only its store acknowledgements count)."""
        feed = self._engines.get(name)
        if feed is None or feed.instance_id != instance_id:
            self.engine_down(name)
            self._engines[name] = _EngineFeed(instance_id, index_id)

    def engine_down(self, name: str) -> None:
        feed = self._engines.pop(name, None)
        if feed is not None and feed.index_id is not None:
            self.index.drop_engine(feed.index_id)

    def on_events(self, msg: KvCacheEvents) -> None:
        feed = self._engines.get(msg.node_name)
        if feed is None or feed.instance_id != msg.instance_id:
            self.stats.num_dropped += 1
            return
        self._learn_geometry(msg)
        key = feed.index_id
        if msg.is_snapshot:
            if key is not None:
                self.index.drop_engine(key)
                self.index.on_stored(key, msg.stored)
            self.stats.num_snapshots += 1
            # events newer than the snapshot that came first were replaced with it: ask again
            feed.is_stale = msg.seq < feed.last_seq
            feed.last_seq = max(feed.last_seq, msg.seq)
            return
        if msg.seq <= feed.last_seq:
            return  # already covered by a snapshot taken after it
        if msg.seq != feed.last_seq + 1 and not feed.is_stale:
            feed.is_stale = True
            self.stats.num_gaps += 1
        feed.last_seq = msg.seq
        self.stats.num_events += 1
        # applied even while stale: the snapshot that follows replaces the device part anyway, and
        # store acknowledgements are never in a snapshot
        if key is not None:
            self.index.on_stored(key, msg.stored)
            self.index.on_evicted(key, msg.evicted)
        self.store.on_written(msg.store_written)

    def on_load_seq(self, name: str, instance_id: int, kv_events_seq: int) -> None:
        """A load report says the engine published up to ``kv_events_seq``."""
        feed = self._engines.get(name)
        if feed is not None and feed.instance_id == instance_id and kv_events_seq > feed.last_seq \
                and not feed.is_stale:
            feed.is_stale = True
            self.stats.num_gaps += 1

    def stale_engines(self) -> list[str]:
        return [name for name, feed in self._engines.items() if feed.is_stale]

    # ---- the router's calls -------------------------------------------------------------
    def block_hashes(self, prompt_token_ids: Sequence[int]) -> list[BlockHash]:
        """The chain hashes of the prompt's full blocks as the engines compute them ([] before
        any engine said which model and block size it uses)."""
        hashes: list[BlockHash] = []
        if self.model_id is not None:
            extend_block_hashes(hashes, prompt_token_ids, self.block_size, self._root)
        return hashes

    def num_indexed_blocks(self, index_id: int) -> int:
        return self.index.num_blocks(index_id)

    def _learn_geometry(self, msg: KvCacheEvents) -> None:
        if self.model_id == msg.model_id and self.block_size == msg.block_size:
            return
        if self.model_id is not None:
            log.warning("cache events of %s name model %r with %d-token blocks, others %r with %d: "
                        "routing follows the latest", msg.node_name, msg.model_id, msg.block_size,
                        self.model_id, self.block_size)
        self.model_id, self.block_size = msg.model_id, msg.block_size
        self._root = root_hash(msg.model_id)
