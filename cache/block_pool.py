"""Paged block allocator with a prefix cache (hash -> block map, refcounts, LRU eviction).

Every block is in exactly one of three states:

    free        ref 0, no hash      -> handed out first by ``allocate``
    evictable   ref 0, hashed       -> still a cache hit; evicted (LRU) when free runs out
    used        ref > 0             -> owned by one or more sequences (shared prefix blocks)

A block gets a hash only once all its positions are computed with known tokens
(``cache_block``); until then another sequence must not read it. Stored/removed events are
queued for cache-aware routing and drained by the engine.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from deepinfer.cache.block_hash import BlockHash


class BlockPoolError(RuntimeError):
    """The pool was asked for something it cannot do (too many blocks, double free)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    block_hash: BlockHash


BlockEvent = BlockStored | BlockEvicted


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block2hash: list[BlockHash | None] = [None] * num_blocks
        self._hash2block: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._events: list[BlockEvent] = []
        self.num_hits = 0
        self.num_queries = 0

    # ---- queries ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash2block)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block2hash[block_id]

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Physical ids of the longest cached prefix of ``block_hashes`` (refcounts untouched)."""
        hits: list[int] = []
        if self.enable_prefix_caching:
            for h in block_hashes:
                block_id = self._hash2block.get(h)
                if block_id is None:
                    break
                hits.append(block_id)
        self.num_queries += len(block_hashes)
        self.num_hits += len(hits)
        return hits

    def cached_prefix_length(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` cached here (no stats, no refcounts)."""
        if not self.enable_prefix_caching:
            return 0
        for i, h in enumerate(block_hashes):
            if h not in self._hash2block:
                return i
        return len(block_hashes)

    def num_allocatable_with(self, hit_blocks: Iterable[int]) -> int:
        """Blocks allocatable after ``touch(hit_blocks)`` (touching takes evictable hits out)."""
        return self.num_free_blocks - sum(1 for b in hit_blocks if self._ref_counts[b] == 0)

    # ---- mutations --------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        if num > self.num_free_blocks:
            raise BlockPoolError(f"asked for {num} blocks, only {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(num):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(block_id)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``lookup_prefix``."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise BlockPoolError(f"block {block_id} is free and uncached; it cannot be shared")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a sequence's table in order: its tail blocks
        become evictable first, so eviction eats chains from the end and keeps shared heads."""
        for block_id in reversed(block_ids):
            rc = self._ref_counts[block_id]
            if rc <= 0:
                raise BlockPoolError(f"double free of block {block_id}")
            self._ref_counts[block_id] = rc - 1
            if rc == 1:
                if self._block2hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def cache_block(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None) -> bool:
        """Register a fully computed block. False when another block already holds this hash
        (two sequences computed the same prefix at once): this one stays private."""
        if not self.enable_prefix_caching:
            return False
        if self._ref_counts[block_id] <= 0:
            raise BlockPoolError(f"cache_block on unreferenced block {block_id}")
        current = self._block2hash[block_id]
        if current is not None:
            if current != block_hash:
                raise BlockPoolError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._hash2block:
            return False
        self._block2hash[block_id] = block_hash
        self._hash2block[block_hash] = block_id
        self._events.append(BlockStored(block_hash, parent_hash))
        return True

    def evict_all_unreferenced(self) -> int:
        """Drop every evictable cached block (e.g. after a weight reload); returns how many."""
        n = len(self._evictable)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            self._free.append(block_id)
        return n

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash cached now (a snapshot for a subscriber that missed events)."""
        return list(self._hash2block)

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def _uncache(self, block_id: int) -> None:
        h = self._block2hash[block_id]
        if h is not None:
            del self._hash2block[h]
            self._block2hash[block_id] = None
            self._events.append(BlockEvicted(h))

    # ---- invariants -------------------------------------------------------------------
    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError unless free + evictable + used == total with consistent
        refcounts and hash map; ``expected_refs`` (block -> holders) checks refcounts exactly."""
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref_counts[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not (free & evictable) and not (free & used) and not (evictable & used), "block in two states"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, (
            f"free {len(free)} + evictable {len(evictable)} + used {len(used)} != total {self.num_blocks}"
        )
        assert all(rc >= 0 for rc in self._ref_counts), "negative refcount"
        for b in free:
            assert self._block2hash[b] is None, f"free block {b} still has a hash"
        for b in evictable:
            assert self._block2hash[b] is not None, f"evictable block {b} has no hash"
        assert len(self._hash2block) == sum(h is not None for h in self._block2hash), "hash map size mismatch"
        for h, b in self._hash2block.items():
            assert self._block2hash[b] == h, f"hash map points to block {b} with another hash"
        if expected_refs is not None:
            for b in range(self.num_blocks):
                assert self._ref_counts[b] == expected_refs.get(b, 0), (
                    f"block {b}: refcount {self._ref_counts[b]} but {expected_refs.get(b, 0)} holders"
                )
