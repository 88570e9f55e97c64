"""Which blocks the KV store holds, as the engines' write acknowledgements tell a gateway.

Any prefill engine can load a block the store holds (ARCHITECTURE.md, "KV store"), so for routing
the store is one more holder of prefixes, shared by every engine. Engines publish the hashes the
store acknowledged (``KvCacheEvents.store_written``); nothing reports the store's own GC or TTL
expiry, so this is a belief, bounded in size: the ``max_blocks`` most recently written hashes
(oldest forgotten first, as the store's LRU GC would). A block believed present but gone costs
one misprediction: the engine's read misses and it computes the rest.

Hashes form a chain (block i's hash covers blocks 0..i), so "the store holds the first k blocks
of this prompt" is the leading run of ``hashes`` found here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from deepinfer.runtime.balance.types import BlockHash


class StorePresence:
    def __init__(self, max_blocks: int = 1 << 20):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first

    def on_written(self, hashes: Iterable[BlockHash]) -> None:
        held = self._hashes
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def num_leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the store is believed to hold."""
        held = self._hashes
        for i, h in enumerate(hashes):
            if h not in held:
                return i
        return len(hashes)

    def __len__(self) -> int:
        return len(self._hashes)
