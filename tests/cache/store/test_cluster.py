"""12 real storage daemons (processes) on loopback, driven through ClusterStore."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
from deepinfer.cache.store.ec import ECConfig
from deepinfer.cache.store.gc import DAY_S
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.transport.protocol import DebugSet, RunGc

pytestmark = pytest.mark.timeout(240)

NUM_NODES = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("store"), NUM_NODES, extra_args=["--debug-hooks"]) as c:
        yield c


@pytest.fixture
async def store(cluster):
    for name in cluster.names:  # a previous test may have killed some
        if not cluster.is_running(name):
            cluster.restart(name)
    async with ClusterStore(cluster.addresses) as s:
        await _broadcast(s, cluster, DebugSet(now=time.time(), delay_ms=0))
        yield s
    assert s.num_pending_requests() == 0


async def _broadcast(store, cluster, msg):
    return await asyncio.gather(*(store.request_node(n, msg) for n in cluster.names if cluster.is_running(n)))


async def _bounce(store, cluster, name):
    """Kill and restart a daemon, and let the client's probe see both (a few tenths of a second)."""
    cluster.kill(name)
    for _ in range(500):
        if not store.reachability.is_reachable(name):
            break
        await asyncio.sleep(0.01)
    cluster.restart(name)
    assert await store.wait_reachable([name])


def _objects(n, seed, lo=1000, hi=60_000):
    rng = random.Random(seed)
    return {rng.randbytes(16): rng.randbytes(rng.randrange(lo, hi)) for _ in range(n)}


async def _put(store, objs, cls="chat"):
    acks = await store.put_blocks(list(objs.items()), traffic_class=cls, deadline=deadline_after(30))
    assert all(a.is_ok for a in acks), [a.message for a in acks if not a.is_ok][:3]
    return acks


async def test_200_objects_survive_two_sigkilled_daemons(cluster, store):
    objs = _objects(200, seed=1)
    acks = await _put(store, objs)
    assert all(a.num_acks == 12 for a in acks)
    victims = ["node-02", "node-09"]
    for name in victims:
        assert cluster.kill(name) < 0  # SIGKILL: no goodbye, no flush
    # the client was told nothing: hedging alone routes around the dead nodes
    res = await store.get_blocks(list(objs), deadline=deadline_after(20))
    assert [r.status for r in res] == [GetStatus.HIT] * 200
    assert all(r.data == objs[r.key] for r in res)
    # once heartbeats mark them down, reads skip them without a hedge
    for name in victims:
        store.mark_down(name)
    num_hedged = store.stats.num_hedged
    res = await store.get_blocks(list(objs)[:50], deadline=deadline_after(20))
    assert all(r.data == objs[r.key] for r in res)
    assert store.stats.num_hedged - num_hedged < 10  # only noise on a busy 2-core machine
    # writes with a quorum of k+1 still succeed on the 10 live nodes? no: 10 < 11 -> refused clearly
    acks = await store.put_blocks([(b"new-object", b"x" * 5000)], traffic_class="chat", deadline=deadline_after(5))
    assert not acks[0].is_ok and "10 of 12 storage nodes are up" in acks[0].message


async def test_write_quorum_allows_one_node_down(cluster, store):
    cluster.kill("node-05")
    store.mark_down("node-05")
    async with ClusterStore(cluster.addresses, ClusterStoreConfig(write_quorum=11)) as quorum_store:
        quorum_store.mark_down("node-05")
        objs = _objects(20, seed=2)
        acks = await _put(quorum_store, objs)
        assert all(a.num_acks == 11 for a in acks)
        cluster.restart("node-05")
        quorum_store.mark_up("node-05")
        assert await quorum_store.wait_reachable(["node-05"])  # its probe reconnects within ~0.1 s
        res = await quorum_store.get_blocks(list(objs), deadline=deadline_after(10))
        assert all(r.data == objs[r.key] for r in res)  # node-05 answers NOT_FOUND, the rest decode


async def test_hedged_read_p99_with_one_daemon_200ms_slow(cluster, store):
    objs = _objects(40, seed=3, lo=20_000, hi=40_000)
    await _put(store, objs)
    keys = list(objs)
    slow = "node-04"

    async def block(num_reads):
        lat = []
        for i in range(num_reads):
            key = keys[i % len(keys)]
            t0 = time.perf_counter()
            (r,) = await store.get_blocks([key], deadline=deadline_after(5))
            lat.append(time.perf_counter() - t0)
            assert r.data == objs[key]
        return lat

    p99 = lambda xs: sorted(xs)[int(0.99 * len(xs)) - 1]  # noqa: E731
    # On a shared 2-core machine one scheduling hiccup moves a 240-sample p99; measure again (up
    # to 3 times) before calling it a failure. Without hedging every attempt would be ~10x off.
    for _ in range(3):
        healthy, slowed = [], []
        for _ in range(4):  # interleave so both see the same background load
            await store.request_node(slow, DebugSet(delay_ms=0))
            healthy += await block(60)
            await store.request_node(slow, DebugSet(delay_ms=200))
            slowed += await block(60)
        await store.request_node(slow, DebugSet(delay_ms=0))
        ratio = p99(slowed) / p99(healthy)
        if ratio <= 1.3:
            break
    assert ratio <= 1.3, f"p99 healthy {p99(healthy) * 1e3:.1f} ms, one slow {p99(slowed) * 1e3:.1f} ms"
    # reads decode from the first 10 of 11 answers: the 200 ms node is (almost) never waited on
    assert sum(t >= 0.2 for t in slowed) <= len(slowed) // 100


async def test_deadline_miss_is_typed_and_cancel_is_clean(cluster, store):
    objs = _objects(5, seed=4)
    await _put(store, objs)
    for name in cluster.names[:3]:  # 3 slow nodes: no key can be decoded fast
        await store.request_node(name, DebugSet(delay_ms=300))
    t0 = time.monotonic()
    res = await store.get_blocks(list(objs), deadline=deadline_after(0.08))
    assert time.monotonic() - t0 < 0.25
    assert [r.status for r in res] == [GetStatus.DEADLINE] * 5 and all(r.data is None for r in res)
    assert store.stats.num_deadline_misses == 5
    task = asyncio.create_task(store.get_blocks(list(objs), deadline=deadline_after(5)))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.num_pending_requests() == 0
    for name in cluster.names[:3]:
        await store.request_node(name, DebugSet(delay_ms=0))
    res = await store.get_blocks(list(objs), deadline=deadline_after(5))
    assert all(r.data == objs[r.key] for r in res)


async def test_corrupt_fragment_is_counted_and_decoded_around(cluster, store):
    key, data = b"corrupt-me-please", random.Random(5).randbytes(100_000)
    await _put(store, {key: data})
    holder = store.placement.coding_group(key, 12)[0]  # fragment 0: always in the first wave
    path = ff.fragment_path(cluster.root / holder / "frags", key)
    raw = bytearray(path.read_bytes())
    for i in range(len(raw) - 50, len(raw) - 40):
        raw[i] ^= 0xA5
    path.write_bytes(bytes(raw))
    before = (await store.node_stats())[holder].num_corrupt
    (res,) = await store.get_blocks([key], deadline=deadline_after(5))
    assert res.data == data
    assert (await store.node_stats())[holder].num_corrupt == before + 1
    assert not path.exists()  # deleted: never served again


async def test_restarted_daemons_serve_their_fragments_without_rewriting(cluster, store):
    objs = _objects(30, seed=6)
    await _put(store, objs)
    restarted = ["node-01", "node-07"]
    for name in restarted:
        await _bounce(store, cluster, name)
    # take two other nodes away: every read now needs the restarted nodes' fragments
    for name in ("node-03", "node-10"):
        cluster.kill(name)
        store.mark_down(name)
    res = await store.get_blocks(list(objs), deadline=deadline_after(10))
    assert all(r.data == objs[r.key] for r in res), [(r.status, r.message) for r in res][:3]
    stats = await store.node_stats()
    for name in restarted:
        assert stats[name].num_puts == 0  # nothing was rewritten
        assert stats[name].num_hits >= 30 and stats[name].num_fragments >= 30


async def test_ttl_per_traffic_class_with_a_fake_clock(cluster, store):
    agent, chat = _objects(10, seed=7), _objects(10, seed=8)
    t0 = time.time()
    await _put(store, agent, cls="agent")
    await _put(store, chat, cls="chat")
    await _broadcast(store, cluster, DebugSet(now=t0 + 3 * DAY_S - 3600))
    res = await store.get_blocks([*agent, *chat], deadline=deadline_after(10))
    assert all(r.is_hit for r in res)
    before = sum(s.num_expired for s in (await store.node_stats()).values())
    await _broadcast(store, cluster, DebugSet(now=t0 + 3 * DAY_S + 60))  # also runs GC
    after = sum(s.num_expired for s in (await store.node_stats()).values())
    assert after - before == 10 * 12  # every fragment of every agent object, on every node
    res = await store.get_blocks([*agent, *chat], deadline=deadline_after(10))
    assert [r.status for r in res] == [GetStatus.MISS] * 10 + [GetStatus.HIT] * 10
    await _broadcast(store, cluster, DebugSet(now=t0 + 7 * DAY_S + 60))
    res = await store.get_blocks(list(chat), deadline=deadline_after(10))
    assert [r.status for r in res] == [GetStatus.MISS] * 10


async def test_fill_past_watermark_evicts_lru_objects_and_keeps_recently_read(tmp_path):
    # 12 small nodes: each holds ~40 fragments of 2 KB; GC from 80% down to 50%
    args = ["--high-watermark", "0.8", "--low-watermark", "0.5", "--gc-interval", "0.2"]
    config = ClusterStoreConfig(ec=ECConfig(k=10, m=2))
    with LocalCluster(tmp_path, NUM_NODES, capacity="100KB", extra_args=args) as cluster:
        async with ClusterStore(cluster.addresses, config) as store:
            objs = _objects(60, seed=9, lo=20_000, hi=20_001)  # ~2.1 KB per fragment
            keys = list(objs)
            hot = keys[:5]
            for i in range(0, 60, 5):
                await _put(store, {k: objs[k] for k in keys[i : i + 5]})
                res = await store.get_blocks(hot, deadline=deadline_after(5))  # keep them recent
                assert all(r.data == objs[r.key] for r in res)
            await asyncio.gather(*(store.request_node(n, RunGc()) for n in cluster.names))
            res = {r.key: r for r in await store.get_blocks(keys, deadline=deadline_after(10))}
            assert all(res[k].data == objs[k] for k in hot)  # read all along: kept
            assert all(res[k].data == objs[k] for k in keys[-5:])  # just written: kept
            assert all(not res[k].is_hit for k in keys[5:20])  # oldest untouched: evicted first
            stats = await store.node_stats()
            assert all(s.num_evicted > 0 and s.used_bytes <= s.high_watermark_bytes for s in stats.values())
