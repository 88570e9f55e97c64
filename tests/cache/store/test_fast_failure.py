"""Dead storage nodes cost milliseconds, not deadlines: 12 real daemons, some SIGKILLed."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
from deepinfer.cache.store.ec import ECConfig
from deepinfer.cache.store.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)


def _objects(n, seed, size=4000):
    rng = random.Random(seed)
    return {rng.randbytes(16): rng.randbytes(size) for _ in range(n)}


async def _until(predicate, timeout_s=5.0):
    give_up_at = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up_at, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_reads_past_m_dead_nodes_end_unavailable_at_once_and_writes_degrade(tmp_path):
    with LocalCluster(tmp_path, 12, capacity="64MiB") as cluster:
        async with ClusterStore(cluster.addresses) as store:
            objs = _objects(30, seed=1)
            acks = await store.put_blocks(list(objs.items()), traffic_class="chat", deadline=deadline_after(30))
            assert all(a.is_ok and a.num_acks == 12 for a in acks)

            # one node dies: writes go on at once with 11 fragments (k+1), reads lose nothing
            cluster.kill("node-04")
            more = _objects(20, seed=2)
            t0 = time.monotonic()
            acks = await store.put_blocks(list(more.items()), traffic_class="chat", deadline=deadline_after(30))
            assert time.monotonic() - t0 < 2.0, "a write waited on the dead node"
            assert all(a.is_ok for a in acks) and {a.num_acks for a in acks} == {11}
            assert store.stats.num_degraded_writes == 20
            res = await store.get_blocks([*objs, *more], deadline=deadline_after(30))
            assert all(r.data == {**objs, **more}[r.key] for r in res)

            # two more die (the client is told nothing): no object has k fragments left
            for name in ("node-07", "node-10"):
                cluster.kill(name)
            t0 = time.monotonic()
            res = await store.get_blocks(list(objs), deadline=deadline_after(30))
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0, f"reads took {elapsed:.2f} s with 3 nodes down"
            assert {r.status for r in res} == {GetStatus.UNAVAILABLE}
            assert all(n in res[0].message for n in ("node-04", "node-07", "node-10")), res[0].message
            await _until(lambda: store.num_pending_requests() == 0, 2.0)  # background repair hints answered

            # a write that cannot reach k+1 nodes fails at once and says why
            t0 = time.monotonic()
            (ack,) = await store.put_blocks([(b"late", b"x" * 5000)], traffic_class="chat", deadline=deadline_after(30))
            assert time.monotonic() - t0 < 1.0
            assert not ack.is_ok and "9 of 12 storage nodes are up" in ack.message and "node-07" in ack.message


async def test_requests_in_flight_to_a_node_that_dies_end_when_it_drops(tmp_path):
    # every node answers after 300 ms: requests are in flight when three of them are killed
    with LocalCluster(tmp_path, 12, capacity="64MiB", extra_args=["--debug-delay-ms", "300"]) as cluster:
        config = ClusterStoreConfig(ec=ECConfig(k=10, m=2), hedge_delay_s=5.0)
        async with ClusterStore(cluster.addresses, config) as store:
            objs = _objects(5, seed=3)
            acks = await store.put_blocks(list(objs.items()), traffic_class="chat", deadline=deadline_after(30))
            assert all(a.is_ok for a in acks)
            await _until(lambda: not store.reachability.unreachable)
            read = asyncio.create_task(store.get_blocks(list(objs), deadline=deadline_after(30)))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            for name in ("node-01", "node-02", "node-03"):
                cluster.kill(name)
            res = await read
            assert time.monotonic() - t0 < 1.0
            assert {r.status for r in res} == {GetStatus.UNAVAILABLE}


async def test_a_node_that_never_came_up_is_skipped(tmp_path):
    with LocalCluster(tmp_path, 12, capacity="64MiB") as cluster:
        nodes = {**cluster.addresses, "ghost": "tcp://127.0.0.1:9"}  # nothing listens there
        async with ClusterStore(nodes) as store:
            await _until(lambda: "ghost" in store.reachability.unreachable)
            objs = _objects(10, seed=4)
            t0 = time.monotonic()
            acks = await store.put_blocks(list(objs.items()), traffic_class="chat", deadline=deadline_after(30))
            res = await store.get_blocks(list(objs), deadline=deadline_after(30))
            assert time.monotonic() - t0 < 2.0
            assert all(a.is_ok and a.num_acks == 12 for a in acks)  # 12 live nodes take the whole group
            assert all(r.data == objs[r.key] for r in res)
