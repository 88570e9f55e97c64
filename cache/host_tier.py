"""Host-memory tier of KV blocks: a bounded, byte-accounted LRU keyed by block hash.

The middle of the engine's lookup walk (device pool -> host tier -> storage cluster). Blocks
evicted from the device pool, or fetched from the store, land here so a later request finds them
without a network round trip. Values are whatever the engine keeps a block's contents in: bytes,
a numpy array or a (pinned) CPU tensor; only their size is looked at.

Not thread-safe: the engine's event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.cache.block_hash import BlockHash


@dataclass(slots=True)
class HostTierStats:
    capacity_bytes: int
    used_bytes: int = 0
    num_blocks: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_puts: int = 0
    num_evictions: int = 0
    num_rejected: int = 0  # single blocks larger than the whole tier

    @property
    def hit_rate(self) -> float:
        num_lookups = self.num_hits + self.num_misses
        return self.num_hits / num_lookups if num_lookups else 0.0


def num_bytes_of(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors, memoryviews
    if isinstance(nbytes, int):
        return nbytes
    return memoryview(value).nbytes


class HostTier:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self._blocks: OrderedDict[BlockHash, tuple[Any, int]] = OrderedDict()  # LRU first
        self._stats = HostTierStats(capacity_bytes=capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._stats.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._stats.used_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: BlockHash) -> Any | None:
        """The block's contents (and mark it most recently used), or None."""
        item = self._blocks.get(block_hash)
        if item is None:
            self._stats.num_misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self._stats.num_hits += 1
        return item[0]

    def put(self, block_hash: BlockHash, value: Any) -> list[BlockHash]:
        """Insert (or refresh) a block; returns the hashes evicted to make room, LRU first.

        A block larger than the whole tier is not kept (counted as rejected)."""
        num_bytes = num_bytes_of(value)
        if num_bytes > self._stats.capacity_bytes:
            self._stats.num_rejected += 1
            self.pop(block_hash)
            return []
        self.pop(block_hash)
        evicted: list[BlockHash] = []
        while self._stats.used_bytes + num_bytes > self._stats.capacity_bytes:
            old_hash, (_, old_bytes) = self._blocks.popitem(last=False)
            self._stats.used_bytes -= old_bytes
            evicted.append(old_hash)
        self._blocks[block_hash] = (value, num_bytes)
        self._stats.used_bytes += num_bytes
        self._stats.num_puts += 1
        self._stats.num_evictions += len(evicted)
        return evicted

    def pop(self, block_hash: BlockHash) -> Any | None:
        """Remove a block without counting it as an eviction (e.g. promoted back to the device)."""
        item = self._blocks.pop(block_hash, None)
        if item is None:
            return None
        self._stats.used_bytes -= item[1]
        return item[0]

    def num_prefix_hits(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` are resident (no recency or stats change)."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self._blocks:
                return i
        return len(block_hashes)

    def stats(self) -> HostTierStats:
        s = self._stats
        return HostTierStats(
            s.capacity_bytes, s.used_bytes, len(self._blocks), s.num_hits, s.num_misses, s.num_puts,
            s.num_evictions, s.num_rejected,
        )  # fmt: skip

    def check_integrity(self) -> None:
        total = sum(num_bytes for _, num_bytes in self._blocks.values())
        assert total == self._stats.used_bytes, f"host tier accounts {self._stats.used_bytes} bytes, holds {total}"
        assert total <= self._stats.capacity_bytes, f"host tier holds {total} bytes over capacity {self._stats.capacity_bytes}"
