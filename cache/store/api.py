"""What the engine sees of the store: async batch get/put with per-key results and a deadline.

    results = await store.get_blocks(block_hashes, deadline=deadline_after(0.05))
    for r in results:            # same order as the keys
        if r.is_hit: ...          # r.data: the object's bytes
        else: ...                 # r.status says why (MISS, DEADLINE, UNAVAILABLE): recompute

    acks = await store.put_blocks([(block_hash, data), ...], traffic_class="chat",
                                  deadline=deadline_after(1.0))

Deadlines are absolute ``time.monotonic()`` values, so one budget can be handed down through
several awaits. A get never raises for a missing or late object: it returns a typed miss and the
engine recomputes (a slow store must never stall a prefill). Cancelling either call cancels every
request it has in flight and leaves the client usable.

Backends: ``ClusterStore`` (erasure-coded over storage nodes, client.py) and ``FsStore`` (the same
files under a mounted directory: local disk, NFS, 3FS FUSE; fs_backend.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class GetStatus(enum.IntEnum):
    HIT = 0
    MISS = 1  # not stored (never written, evicted, expired, or too few good fragments left)
    DEADLINE = 2  # not assembled before the caller's deadline
    UNAVAILABLE = 3  # too few of its storage nodes reachable (``message`` names the missing ones)


@dataclass(slots=True)
class GetResult:
    key: bytes
    status: GetStatus
    data: bytes | None = None
    message: str = ""  # why, for UNAVAILABLE

    @property
    def is_hit(self) -> bool:
        return self.status == GetStatus.HIT


@dataclass(slots=True)
class PutResult:
    key: bytes
    is_ok: bool
    num_acks: int  # fragments (cluster) or files (fs) acknowledged as stored
    message: str = ""


@runtime_checkable
class ObjectStore(Protocol):
    async def get_blocks(self, keys: Sequence[bytes], deadline: float) -> list[GetResult]: ...

    async def put_blocks(
        self, items: Sequence[tuple[bytes, object]], *, traffic_class: str, deadline: float
    ) -> list[PutResult]: ...

    async def close(self) -> None: ...


def deadline_after(seconds: float) -> float:
    """An absolute deadline ``seconds`` from now, on the clock every store call uses."""
    return time.monotonic() + seconds


def seconds_left(deadline: float) -> float:
    return deadline - time.monotonic()


@dataclass(slots=True)
class ClientStats:
    """Counters a store client keeps (exported as metrics by the process that owns it)."""

    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_deadline_misses: int = 0
    num_unavailable: int = 0
    num_hedged: int = 0  # keys whose read went past the first k+1 nodes
    num_puts: int = 0
    num_put_failures: int = 0
    num_degraded_writes: int = 0  # stored, but with fewer than k+m fragments (repair adds the rest)
    num_repair_hints: int = 0  # objects reported to storage nodes as short of fragments
    num_bytes_read: int = 0
    num_bytes_written: int = 0
