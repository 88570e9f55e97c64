"""`deepinfer node --role storage` in-process: the runtime Node + StorageRole, heartbeats to a client."""

from __future__ import annotations

import asyncio

from deepinfer.transport.ports import free_tcp_port as _free_port  # below the ephemeral range
from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.cache.store.client import ClusterStore
from deepinfer.cache.store.node_role import make_role
from deepinfer.runtime.cluster_config import NodeRole, parse_cluster_config
from deepinfer.runtime.node import Node, NodeSettings


def _config():
    p = [_free_port() for _ in range(5)]
    return parse_cluster_config(f"""
[cluster]
heartbeat_interval_s = 0.05
missed_beats = 3
[storage]
ec_k = 1
ec_m = 0
[[nodes]]
name = "store-0"
role = "storage"
control = "tcp://127.0.0.1:{p[0]}"
events = "tcp://127.0.0.1:{p[1]}"
data = "tcp://127.0.0.1:{p[2]}"
[[nodes]]
name = "prefill-0"
role = "prefill"
control = "tcp://127.0.0.1:{p[3]}"
events = "tcp://127.0.0.1:{p[4]}"
""")


async def _wait_for(predicate, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_storage_role_serves_reports_metrics_and_heartbeats_mark_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    from deepinfer import envs

    monkeypatch.setattr(envs, "_snapshot", envs.load())
    config = _config()
    storage_node = Node(NodeSettings.from_cluster(config, "store-0"),
                        [make_role(role=NodeRole.STORAGE, config=config, node_name="store-0")])
    engine_node = Node(NodeSettings.from_cluster(config, "prefill-0"))
    store = ClusterStore.from_cluster_config(config)
    engine_node.add_peer_listener(store.on_peer_event)
    await storage_node.start()
    await engine_node.start()
    await store.start()
    try:
        acks = await store.put_blocks([(b"block", b"kv" * 1000)], traffic_class="chat", deadline=deadline_after(5))
        assert acks[0].is_ok
        (hit,) = await store.get_blocks([b"block"], deadline=deadline_after(5))
        assert hit.data == b"kv" * 1000
        assert (tmp_path / "storage" / "store-0" / "index.sqlite3").exists()
        assert storage_node.metrics.registry.get_sample_value("deepinfer_storage_fragments", {"node": "store-0"}) == 1
        await _wait_for(lambda: engine_node.heartbeat.table.is_up("store-0"))
        await storage_node.drain(1.0)  # graceful: Leave -> PeerDown at the engine at once
        await _wait_for(lambda: store.is_down("store-0"))
        (miss,) = await store.get_blocks([b"block"], deadline=deadline_after(1))
        assert miss.status == GetStatus.UNAVAILABLE  # no node left to ask: the engine recomputes
    finally:
        await store.close()
        await engine_node.stop()
        await storage_node.stop()
