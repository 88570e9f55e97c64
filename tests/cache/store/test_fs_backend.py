from __future__ import annotations

import asyncio
import os
import time

import pytest

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.api import GetStatus, ObjectStore, deadline_after
from deepinfer.cache.store.fs_backend import FsStore
from deepinfer.cache.store.gc import DAY_S, Watermarks


class FakeClock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self):
        return self.now


async def test_put_get_round_trip_and_interface(tmp_path):
    store = FsStore(tmp_path)
    assert isinstance(store, ObjectStore)
    objs = {os.urandom(16): os.urandom(n) for n in (1, 100, 70_000)}
    acks = await store.put_blocks(list(objs.items()), traffic_class="chat", deadline=deadline_after(5))
    assert all(a.is_ok and a.num_acks == 1 for a in acks)
    keys = [*objs, b"missing-key"]
    res = await store.get_blocks(keys, deadline=deadline_after(5))
    assert [r.key for r in res] == keys
    assert [r.data for r in res[:3]] == list(objs.values())
    assert res[3].status == GetStatus.MISS and res[3].data is None
    assert (store.stats.num_hits, store.stats.num_misses) == (3, 1)
    # same on-disk format as a storage node: a self-describing fragment file (k=1, m=0)
    key = next(iter(objs))
    record, payload = ff.parse(ff.read_file(ff.fragment_path(tmp_path / "objects", key)))
    assert (record.header.k, record.header.m, record.traffic_class) == (1, 0, "chat")
    assert bytes(payload) == objs[key]
    await store.close()


async def test_corrupt_file_is_a_counted_miss(tmp_path):
    store = FsStore(tmp_path)
    await store.put_blocks([(b"k", b"x" * 5000)], traffic_class="agent", deadline=deadline_after(5))
    path = ff.fragment_path(tmp_path / "objects", b"k")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (res,) = await store.get_blocks([b"k"], deadline=deadline_after(5))
    assert res.status == GetStatus.MISS and store.num_corrupt == 1
    assert not path.exists()
    await store.close()


async def test_ttl_and_lru_gc_over_a_shared_directory(tmp_path):
    clock = FakeClock()
    writer, reader = FsStore(tmp_path, clock=clock), FsStore(tmp_path, clock=clock)
    await writer.put_blocks([(b"agent", b"a" * 1000)], traffic_class="agent", deadline=deadline_after(5))
    await writer.put_blocks([(b"chat", b"c" * 1000)], traffic_class="chat", deadline=deadline_after(5))
    clock.now += 3 * DAY_S + 1
    got = await reader.get_blocks([b"agent", b"chat"], deadline=deadline_after(5))
    assert [r.status for r in got] == [GetStatus.MISS, GetStatus.HIT]  # expired is never served
    plan = reader.run_gc(Watermarks(1 << 30))
    assert plan.expired == [b"agent"] and plan.evicted == []
    # LRU by mtime: the object read most recently survives a fill past the high mark
    for i in range(4):
        await writer.put_blocks([(b"o%d" % i, bytes(1000))], traffic_class="chat", deadline=deadline_after(5))
        old = time.time() - 100 + i
        os.utime(ff.fragment_path(tmp_path / "objects", b"o%d" % i), (old, old))
    await reader.get_blocks([b"o0"], deadline=deadline_after(5))  # refreshes o0's mtime
    size = ff.fragment_path(tmp_path / "objects", b"o1").stat().st_size
    plan = reader.run_gc(Watermarks(capacity_bytes=6 * size, high=0.7, low=0.5))
    assert b"o0" not in plan.evicted and plan.evicted[:2] == [b"o1", b"o2"]
    await writer.close()
    await reader.close()


async def test_deadline_and_cancellation(tmp_path):
    store = FsStore(tmp_path, num_io_threads=1)
    await store.put_blocks([(b"k", b"v")], traffic_class="chat", deadline=deadline_after(5))
    res = await store.get_blocks([b"k"] * 3, deadline=time.monotonic() - 1)  # already past
    assert all(r.status == GetStatus.DEADLINE for r in res)
    assert store.stats.num_deadline_misses == 3
    task = asyncio.create_task(store.get_blocks([b"k"] * 50, deadline=deadline_after(5)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (res,) = await store.get_blocks([b"k"], deadline=deadline_after(5))  # still usable
    assert res.data == b"v"
    bad = await store.put_blocks([(b"", b"v")], traffic_class="chat", deadline=deadline_after(5))
    assert not bad[0].is_ok and "key" in bad[0].message
    await store.close()
