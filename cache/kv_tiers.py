"""The tiers behind the device pool that the engine's prefix lookup walks: host memory, then store.

    a request's block hashes (only full blocks, never the last token's block):
    [h0 ... h(d-1)] [hd ... h(d+H-1)] [h(d+H) ... h(d+H+S-1)] [ ... recomputed ... ]
    |-- device ----| |--- host tier --| |------- store --------|
     BlockPool        host_run():        read_store(): one batched, deadline-bound get;
     (the caller)     in memory, now     the leading run of hits (a miss or a late key ends it)

Only a *consecutive* run counts in every tier: block i's KV is only usable when blocks 0..i-1 are
too (the hash chain makes block i's hash depend on them anyway).

Store keys are the block hash salted with the KV layout fingerprint (kv_block_codec.py), so
engines of another model geometry or cache dtype never read each other's bytes. The host tier is
shared between the engine thread and the write-behind thread; ``KVTiers`` guards it with a lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.host_tier import HostTier, HostTierStats
from deepinfer.cache.store.api import GetStatus, ObjectStore

log = logging.getLogger(__name__)

TIER_DEVICE, TIER_HOST, TIER_STORE = "device", "host", "store"
TIERS = (TIER_DEVICE, TIER_HOST, TIER_STORE)


@dataclass(slots=True)
class StoreRead:
    """The leading run of store hits for the hashes asked, and why the run ended."""

    blocks: list[bytes]  # contents of hashes[0 .. len(blocks)) in order
    num_requested: int
    end_status: GetStatus | None = None  # status of the first non-hit; None when all hit
    seconds: float = 0.0

    @property
    def is_deadline_miss(self) -> bool:
        return self.end_status == GetStatus.DEADLINE


@dataclass(slots=True)
class StoreWrite:
    num_ok: int
    num_failed: int
    first_error: str = ""
    is_ok: tuple[bool, ...] = ()  # per item written, in order


class KVTiers:
    def __init__(self, host: HostTier | None, store: ObjectStore | None, *, layout_fingerprint: bytes = b""):
        self.host = host
        self.store = store
        self.layout_fingerprint = layout_fingerprint
        self._host_lock = threading.Lock()

    @property
    def has_store(self) -> bool:
        return self.store is not None

    def store_key(self, block_hash: BlockHash) -> bytes:
        return hashlib.blake2b(self.layout_fingerprint + block_hash, digest_size=16, person=b"deepinfer-kvkey").digest()

    # ---- host tier (any thread) ---------------------------------------------------------
    def host_run(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the host tier holds (no recency change)."""
        if self.host is None:
            return 0
        with self._host_lock:
            return self.host.num_prefix_hits(block_hashes)

    def host_get(self, block_hash: BlockHash) -> bytes | None:
        if self.host is None:
            return None
        with self._host_lock:
            return self.host.get(block_hash)

    def host_put(self, block_hash: BlockHash, data: bytes) -> None:
        if self.host is not None:
            with self._host_lock:
                self.host.put(block_hash, data)

    def host_stats(self) -> HostTierStats | None:
        if self.host is None:
            return None
        with self._host_lock:
            return self.host.stats()

    # ---- store (the I/O thread's event loop) --------------------------------------------
    async def read_store(self, block_hashes: Sequence[BlockHash], deadline: float) -> StoreRead:
        """One batched read of ``block_hashes``; keeps the leading run of hits. Never raises for
        a missing or late block (the engine recomputes from where the run ends)."""
        if self.store is None or not block_hashes:
            return StoreRead([], len(block_hashes))
        t0 = time.monotonic()
        results = await self.store.get_blocks([self.store_key(h) for h in block_hashes], deadline)
        out = StoreRead([], len(block_hashes), seconds=time.monotonic() - t0)
        for r in results:
            if not r.is_hit:
                out.end_status = r.status
                break
            out.blocks.append(r.data)
        return out

    async def write_store(self, items: Sequence[tuple[BlockHash, bytes]], *, traffic_class: str, deadline: float) -> StoreWrite:
        if self.store is None or not items:
            return StoreWrite(0, 0)
        acks = await self.store.put_blocks(
            [(self.store_key(h), data) for h, data in items], traffic_class=traffic_class, deadline=deadline
        )
        failed = [a for a in acks if not a.is_ok]
        return StoreWrite(len(acks) - len(failed), len(failed), failed[0].message if failed else "",
                          tuple(a.is_ok for a in acks))
