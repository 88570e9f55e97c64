"""KVTiers: the host/store walk keeps only the leading run, store keys carry the layout."""

from __future__ import annotations

from deepinfer.cache.host_tier import HostTier
from deepinfer.cache.kv_tiers import KVTiers
from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.cache.store.fs_backend import FsStore


def _hashes(n):
    return [bytes([i]) * 16 for i in range(n)]


async def test_store_read_keeps_the_leading_run_of_hits(tmp_path):
    store = FsStore(tmp_path)
    tiers = KVTiers(None, store, layout_fingerprint=b"layout-a")
    try:
        h = _hashes(5)
        write = await tiers.write_store([(h[0], b"zero"), (h[1], b"one"), (h[3], b"three")], traffic_class="chat",
                                        deadline=deadline_after(10))
        assert (write.num_ok, write.num_failed) == (3, 0)
        read = await tiers.read_store(h, deadline_after(10))
        # block 3 is stored but unusable: block 2 (its prefix) is missing
        assert read.blocks == [b"zero", b"one"] and read.end_status == GetStatus.MISS
        assert not read.is_deadline_miss and read.num_requested == 5
        full = await tiers.read_store(h[:2], deadline_after(10))
        assert full.blocks == [b"zero", b"one"] and full.end_status is None
        # an engine with another KV layout never sees these bytes
        other = KVTiers(None, store, layout_fingerprint=b"layout-b")
        assert other.store_key(h[0]) != tiers.store_key(h[0])
        assert (await other.read_store(h[:1], deadline_after(10))).blocks == []
    finally:
        await store.close()


def test_host_run_counts_consecutive_blocks_without_touching_recency():
    tiers = KVTiers(HostTier(capacity_bytes=3 * 4), None)
    h = _hashes(4)
    for i in (0, 1, 3):
        tiers.host_put(h[i], b"abcd")
    assert tiers.host_run(h) == 2 and tiers.host_run(h[3:]) == 1 and tiers.host_run(h[2:]) == 0
    tiers.host_put(h[2], b"abcd")  # capacity 3 blocks: evicts the least recently used (h0)
    assert tiers.host_run(h) == 0 and tiers.host_run(h[1:]) == 3
    assert tiers.host_get(h[1]) == b"abcd" and tiers.host_stats().num_evictions == 1
    assert not tiers.has_store and KVTiers(None, None).host_run(h) == 0
