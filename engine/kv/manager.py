"""The scheduler's view of KV state: a request's blocks (prefix cache included) and its slot.

Requests hold their physical block ids in ``block_ids`` (the SeqStep block table) and their SWA
slot in ``slot``; this manager is the only code that moves them in or out of the pools::

    block_ids:  [hit 0][hit 1] ... [hit h-1][new h] ... [new k]      hits: shared, read-only
                |--- num_registered_blocks (in the prefix cache) ---|   grow as blocks fill

The scheduler only appends to a ``block_ids`` list it handed to a SeqStep; trimming and
releasing replace the list, so a step in flight keeps a valid table.

With KV tiers (``offload``, engine/kv/offload.py, given at construction) the prefix lookup walks device
pool -> host tier -> store: ``is_kv_ready`` keeps a request waiting (without holding the queue)
while its blocks are read from the store, ``lookup_prefix`` turns host/store blocks into
ordinary device hits, and every newly registered block is queued for write-behind.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.core.request import Request

if TYPE_CHECKING:
    from deepinfer.engine.kv.offload import KVOffload
    from deepinfer.engine.kv.swa_slots import SwaSlotManager

# Splits not picked up by the engine (a request aborted before its first output) are dropped
# oldest first past this many.
_MAX_UNREAD_SPLITS = 4096


class KVManager:
    def __init__(self, block_pool: BlockPool, slot_pool: SlotPool, *, offload: KVOffload | None = None,
                 swa_slots: SwaSlotManager | None = None) -> None:
        self.pool = block_pool
        self.slots = slot_pool
        self.block_size = block_pool.block_size
        # [swa-slots hooks] engine/kv/swa_slots.py: blocks computed over an approximate (bounded-
        # replay) SWA state stay out of the prefix cache; a sequence's SWA slot snapshot is saved
        # when it releases its blocks (finish or preempt), while its block hashes are still known
        self.may_cache_blocks: Callable[[Request], bool] | None = swa_slots.may_cache_blocks if swa_slots else None
        self.on_release: Callable[[Request], None] | None = swa_slots.on_release if swa_slots else None
        self.offload = offload
        # request id -> cached tokens by tier at its first admission, until the engine puts it
        # into the request's metrics (pop_cached_tokens_by_tier)
        self._rid2tier_split: OrderedDict[str, dict[str, int]] = OrderedDict()

    def _lookup_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes a prefix lookup may hit: never the whole sequence (at least one token is
        computed to produce logits), none for prompt-logprob requests (they need the logits of
        every prompt position)."""
        if not req.block_hashes or req.sampling_params.prompt_logprobs is not None:
            return []
        return req.block_hashes[: (req.num_tokens - 1) // self.block_size]

    def is_kv_ready(self, req: Request) -> bool:
        """False while the KV tiers are still reading this waiting request's prefix blocks."""
        if self.offload is None:
            return True
        return self.offload.is_ready(req, self.pool, self._lookup_hashes(req))

    def lookup_prefix(self, req: Request) -> list[int]:
        """Device blocks of the longest known prefix (host/store blocks promoted into the
        device pool first when tiers are attached); refcounts are taken by ``admit``."""
        hashes = self._lookup_hashes(req)
        if not hashes:
            return []
        hits = self.pool.lookup_prefix(hashes)
        if self.offload is not None and len(hits) < len(hashes):
            hits = self.offload.extend_hits(req, self.pool, hits, hashes)
        return hits

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
        if req.num_cached_tokens < 0:  # first admission: what the request reports as cached
            if self.offload is not None:
                split = self.offload.tier_split(req, hits, self._lookup_hashes(req))
            else:
                split = {TIER_DEVICE: len(hits) * self.block_size, TIER_HOST: 0, TIER_STORE: 0}
            self._rid2tier_split[req.request_id] = split
            while len(self._rid2tier_split) > _MAX_UNREAD_SPLITS:
                self._rid2tier_split.popitem(last=False)
        if self.offload is not None:
            self.offload.forget(req)
        return True

    def pop_cached_tokens_by_tier(self, request_id: str) -> dict[str, int] | None:
        """The request's cached tokens by tier ("device"/"host"/"store"), once."""
        return self._rid2tier_split.pop(request_id, None)

    def ensure_blocks(self, req: Request, end: int) -> bool:
        """Blocks for positions ``[0, end)``; False (nothing changed) when the pool is short."""
        need = _cdiv(end, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def register_blocks(self, req: Request, computed_end: int, *, write_behind: bool = True) -> None:
        """Publish full blocks whose positions are all computed with known tokens.
        ``write_behind=False``: blocks imported from another engine, which wrote them already."""
        num_full = min(computed_end, req.num_tokens) // self.block_size
        if num_full <= req.num_registered_blocks:
            return
        if self.may_cache_blocks is not None and not self.may_cache_blocks(req):
            return
        num_full = min(num_full, len(req.block_hashes), len(req.block_ids))
        new_blocks = []
        for i in range(req.num_registered_blocks, num_full):
            parent = req.block_hashes[i - 1] if i else None
            if self.pool.cache_block(req.block_ids[i], req.block_hashes[i], parent):
                new_blocks.append((req.block_ids[i], req.block_hashes[i]))
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)
        if self.offload is not None and new_blocks and write_behind:
            # written behind to the host tier / store, under the request's TTL class
            self.offload.on_registered(new_blocks, req.sampling_params.traffic_class)

    def trim_blocks(self, req: Request) -> None:
        """Free blocks past the known tokens (after speculative tokens were rejected)."""
        keep = max(_cdiv(req.num_tokens, self.block_size), req.num_registered_blocks)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            req.block_ids = req.block_ids[:keep]

    def release(self, req: Request) -> None:
        if self.on_release is not None:
            self.on_release(req)
        if self.offload is not None:
            self.offload.forget(req)
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
