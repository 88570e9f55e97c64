"""The scheduler's view of KV state: a request's blocks (prefix cache included) and its slot.

Requests hold their physical block ids in ``block_ids`` (the SeqStep block table) and their SWA
slot in ``slot``; this manager is the only code that moves them in or out of the pools::

    block_ids:  [hit 0][hit 1] ... [hit h-1][new h] ... [new k]      hits: shared, read-only
                |--- num_registered_blocks (in the prefix cache) ---|   grow as blocks fill

The scheduler only appends to a ``block_ids`` list it handed to a SeqStep; trimming and
releasing replace the list, so a step in flight keeps a valid table.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.request import Request


class KVManager:
    def __init__(self, block_pool: BlockPool, slot_pool: SlotPool) -> None:
        self.pool = block_pool
        self.slots = slot_pool
        self.block_size = block_pool.block_size

    def lookup_prefix(self, req: Request) -> list[int]:
        """Cached blocks of the longest known prefix; never the whole sequence (at least one
        token is computed to produce logits), none for prompt-logprob requests (they need the
        logits of every prompt position)."""
        if not req.block_hashes or req.sampling_params.prompt_logprobs is not None:
            return []
        num_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup_prefix(req.block_hashes[:num_blocks])

    def admit(self, req: Request, hits: list[int], end: int) -> bool:
        """Give a waiting request its slot, the hit blocks and new blocks up to position ``end``;
        False (nothing changed) when blocks or slots are short."""
        num_new = max(0, _cdiv(end, self.block_size) - len(hits))
        if num_new > self.pool.num_allocatable_with(hits) or self.slots.num_free_slots == 0:
            return False
        self.pool.touch(hits)
        req.block_ids = hits + self.pool.allocate(num_new)
        req.num_registered_blocks = len(hits)
        req.slot = self.slots.allocate()
        return True

    def ensure_blocks(self, req: Request, end: int) -> bool:
        """Blocks for positions ``[0, end)``; False (nothing changed) when the pool is short."""
        need = _cdiv(end, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def register_blocks(self, req: Request, computed_end: int) -> None:
        """Publish full blocks whose positions are all computed with known tokens."""
        num_full = min(computed_end, req.num_tokens) // self.block_size
        if num_full <= req.num_registered_blocks:
            return
        num_full = min(num_full, len(req.block_hashes), len(req.block_ids))
        for i in range(req.num_registered_blocks, num_full):
            parent = req.block_hashes[i - 1] if i else None
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i], parent)
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def trim_blocks(self, req: Request) -> None:
        """Free blocks past the known tokens (after speculative tokens were rejected)."""
        keep = max(_cdiv(req.num_tokens, self.block_size), req.num_registered_blocks)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            req.block_ids = req.block_ids[:keep]

    def release(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        req.num_registered_blocks = 0

    def check_integrity(self, running: Iterable[Request]) -> None:
        """Pool and slot invariants, with refcounts and slot holders taken from ``running``, and
        every cached block in a table holding exactly that request's tokens."""
        refs: dict[int, int] = {}
        slots = []
        for req in running:
            assert len(req.block_ids) >= _cdiv(req.num_computed_tokens, self.block_size), f"{req.request_id}: too few blocks"
            assert req.num_registered_blocks <= len(req.block_ids)
            slots.append(req.slot)
            for i, block_id in enumerate(req.block_ids):
                refs[block_id] = refs.get(block_id, 0) + 1
                h = self.pool.block_hash(block_id)
                if h is not None:
                    assert i < len(req.block_hashes) and h == req.block_hashes[i], (
                        f"{req.request_id}: block {block_id} at index {i} is cached under another prefix"
                    )
        self.pool.check_integrity(refs)
        self.slots.check_integrity(slots)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
