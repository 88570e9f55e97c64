"""Which engine holds which prefix: a map block hash -> bit mask of engines, fed by cache events.

Engines publish ``stored`` / ``evicted`` block hashes; the index mirrors them exactly (no guessing,
unlike a router-side approximate tree). Because block hashes form a chain (block i's hash covers
blocks 0..i), "engine e holds the first k blocks of this prompt" is "the hashes h0..h(k-1) all
have bit e set", and one walk over the prompt's hashes answers it for every engine at once:

    hashes:        h0    h1    h2    h3    h4
    alive mask:  {0,2,5} {0,5}  {0,5}  {5}   {}      -> engine 2: 1 block, 0: 3 blocks, 5: 4 blocks

The walk stops when no engine is left, so it costs O(longest hit), not O(engines x prompt).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deepinfer.runtime.balance.types import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._hash2mask: dict[BlockHash, int] = {}
        self._engine2num_blocks: dict[int, int] = {}

    # ---- cache events ---------------------------------------------------------------
    def on_stored(self, engine_id: int, hashes: Iterable[BlockHash]) -> None:
        bit = _bit(engine_id)
        hash2mask = self._hash2mask
        num_new = 0
        for h in hashes:
            mask = hash2mask.get(h, 0)
            if not mask & bit:
                hash2mask[h] = mask | bit
                num_new += 1
        self._engine2num_blocks[engine_id] = self._engine2num_blocks.get(engine_id, 0) + num_new

    def on_evicted(self, engine_id: int, hashes: Iterable[BlockHash]) -> None:
        bit = _bit(engine_id)
        hash2mask = self._hash2mask
        num_gone = 0
        for h in hashes:
            mask = hash2mask.get(h, 0)
            if mask & bit:
                mask &= ~bit
                if mask:
                    hash2mask[h] = mask
                else:
                    del hash2mask[h]
                num_gone += 1
        if num_gone:
            self._engine2num_blocks[engine_id] -= num_gone

    def drop_engine(self, engine_id: int) -> None:
        """The engine left (or restarted with an empty cache): forget everything it held."""
        bit = _bit(engine_id)
        for h in [h for h, m in self._hash2mask.items() if m & bit]:
            self.on_evicted(engine_id, (h,))
        self._engine2num_blocks.pop(engine_id, None)

    # ---- queries --------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> dict[int, int]:
        """engine id -> number of leading blocks of ``hashes`` it holds (engines with 0 omitted)."""
        engine2num_blocks: dict[int, int] = {}
        if not hashes:
            return engine2num_blocks
        get = self._hash2mask.get
        alive = get(hashes[0], 0)
        if not alive:
            return engine2num_blocks
        i = 0
        for i, h in enumerate(hashes):
            still = get(h, 0) & alive
            if still != alive:
                _record(engine2num_blocks, alive & ~still, i)
                if not still:
                    return engine2num_blocks
                alive = still
        _record(engine2num_blocks, alive, i + 1)
        return engine2num_blocks

    def num_blocks(self, engine_id: int) -> int:
        return self._engine2num_blocks.get(engine_id, 0)

    def check_integrity(self) -> None:
        counts: dict[int, int] = {}
        for h, mask in self._hash2mask.items():
            assert mask > 0, f"block {h!r} is indexed with an empty engine mask"
            while mask:
                low = mask & -mask
                e = low.bit_length() - 1
                counts[e] = counts.get(e, 0) + 1
                mask ^= low
        for e in set(counts) | set(self._engine2num_blocks):
            assert counts.get(e, 0) == self._engine2num_blocks.get(e, 0), (
                f"engine {e}: {counts.get(e, 0)} indexed blocks but the count says {self._engine2num_blocks.get(e, 0)}"
            )


def _record(engine2num_blocks: dict[int, int], mask: int, num_blocks: int) -> None:
    while mask:
        low = mask & -mask
        engine2num_blocks[low.bit_length() - 1] = num_blocks
        mask ^= low


def _bit(engine_id: int) -> int:
    if engine_id < 0:
        raise ValueError(f"engine ids must be non-negative ints, got {engine_id}")
    return 1 << engine_id
