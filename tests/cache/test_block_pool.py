from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_hash import MultiModalSpan, extend_block_hashes, hash_block, root_hash
from deepinfer.cache.block_pool import BlockEvicted, BlockPool, BlockPoolError, BlockStored
from deepinfer.cache.slot_pool import SlotPool, SlotPoolError


def _hashes(tokens, bs=4, model="m", salt="", spans=()):
    out = []
    extend_block_hashes(out, tokens, bs, root_hash(model, salt), spans)
    return out


def test_hash_chain_is_stable_and_salted():
    tokens = list(range(10))
    h = _hashes(tokens)
    assert len(h) == 2  # only full blocks
    assert h == _hashes(tokens)
    # the chain: block 1 depends on block 0
    assert _hashes([99] + tokens[1:])[1] != h[1]
    assert _hashes(tokens, model="other")[0] != h[0]
    assert _hashes(tokens, salt="tenant")[0] != h[0]
    # a multimodal input changes exactly the blocks it overlaps (and, through the chain, later ones)
    spans = (MultiModalSpan(offset=5, length=2, content_hash="img-a"),)
    hm = _hashes(tokens, spans=spans)
    assert hm[0] == h[0] and hm[1] != h[1]
    assert _hashes(tokens, spans=(MultiModalSpan(5, 2, "img-b"),))[1] != hm[1]
    # digest is a fixed function of its inputs (not Python's randomised hash())
    assert hash_block(b"\x00" * 16, [1, 2, 3]).hex() == hash_block(b"\x00" * 16, [1, 2, 3]).hex()
    assert len(h[0]) == 16
    # incremental extension gives the same chain as hashing all at once
    inc = []
    for n in range(1, 11):
        extend_block_hashes(inc, tokens[:n], 4, root_hash("m"))
    assert inc == h


def test_allocate_free_cache_lookup_and_lru_eviction():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.allocate(3)
    ha = _hashes(list(range(12)))
    for i, b in enumerate(a):
        assert pool.cache_block(b, ha[i], ha[i - 1] if i else None)
    assert [type(e) for e in pool.drain_events()] == [BlockStored] * 3
    pool.check_integrity({b: 1 for b in a})
    assert pool.lookup_prefix(ha) == a
    assert pool.lookup_prefix([b"x" * 16] + ha) == []
    pool.free(a)
    # cached + unreferenced: still hits, counted as free
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    pool.check_integrity({})
    # uncached blocks go first; cached ones are evicted tail-first (the chain's last block)
    b = pool.allocate(3)
    assert set(b).isdisjoint(a)
    assert pool.num_cached_blocks == 3
    c = pool.allocate(1)
    assert c == [a[2]]
    assert pool.drain_events() == [BlockEvicted(ha[2])]
    assert pool.lookup_prefix(ha) == a[:2]
    pool.touch(a[:2])  # a hit takes them out of the evictable set
    assert pool.num_free_blocks == 0
    with pytest.raises(BlockPoolError):
        pool.allocate(1)
    pool.check_integrity({**{x: 1 for x in b}, c[0]: 1, a[0]: 1, a[1]: 1})


def test_shared_blocks_refcount_and_duplicates():
    pool = BlockPool(num_blocks=4, block_size=2)
    h = _hashes([1, 2, 3, 4], bs=2)
    x = pool.allocate(2)
    pool.cache_block(x[0], h[0], None)
    pool.cache_block(x[1], h[1], h[0])
    pool.touch(x)  # a second sequence shares the prefix
    assert pool.ref_count(x[0]) == 2
    pool.free(x)
    assert pool.ref_count(x[0]) == 1 and pool.num_free_blocks == 2
    # the same content computed privately elsewhere is not registered twice
    y = pool.allocate(1)
    assert not pool.cache_block(y[0], h[0], None)
    assert pool.block_hash(y[0]) is None
    pool.free(y)
    pool.free(x)
    pool.check_integrity({})
    with pytest.raises(BlockPoolError):
        pool.free([x[0]])
    assert pool.evict_all_unreferenced() == 2
    assert pool.num_cached_blocks == 0
    pool.check_integrity({})


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    h = _hashes([1, 2], bs=2)
    b = pool.allocate(1)
    assert not pool.cache_block(b[0], h[0], None)
    assert pool.lookup_prefix(h) == []


def test_check_integrity_catches_corruption():
    pool = BlockPool(num_blocks=4, block_size=2)
    b = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity({b[0]: 1})  # one holder missing
    pool._free.append(b[0])  # a used block also on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    pool = BlockPool(num_blocks=32, block_size=2)
    held: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            n = rng.randint(1, min(4, pool.num_free_blocks))
            toks = [rng.randint(0, 3) for _ in range(2 * n)]
            hs = _hashes(toks, bs=2)
            hits = pool.lookup_prefix(hs)
            if len(hits) < n and n - len(hits) <= pool.num_allocatable_with(hits):
                pool.touch(hits)
                new = pool.allocate(n - len(hits))
                blocks = hits + new
                for i in range(len(hits), n):
                    pool.cache_block(blocks[i], hs[i], hs[i - 1] if i else None)
                held.append(blocks)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        refs: dict[int, int] = {}
        for blocks in held:
            for x in blocks:
                refs[x] = refs.get(x, 0) + 1
        pool.check_integrity(refs)
    assert pool.num_hits > 0


def test_slot_pool():
    slots = SlotPool(2)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and slots.allocate() is None
    slots.check_integrity([a, b])
    slots.free(a)
    with pytest.raises(SlotPoolError):
        slots.free(a)
    slots.check_integrity([b])
    with pytest.raises(AssertionError):
        slots.check_integrity([a])
