"""The storage role of ``deepinfer node --role storage``: a StorageNode inside the runtime's Node.

The Node brings the control channel and heartbeats (so engines' ClusterStores see this node go
down and come back); the role serves fragments on the node's ``data`` address from the cluster
config and adds its stats to the node's Prometheus registry.

Fragments live in ``<DEEPINFER_CACHE_DIR>/storage/<node name>`` with 10 GiB capacity and the
default TTLs, unless the config's ``[storage]`` section carries ``dir`` (a per-node subdirectory
is used), ``capacity_bytes``, ``ttl`` ("agent=3d,chat=7d"), ``admin_from`` (networks allowed to
send admin messages) and ``membership_file`` (the storage membership record: the node repairs,
cache/store/repair.py): read when present, so adding those keys to runtime/cluster_config.py's
StorageSection is all it takes.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs
from deepinfer.cache.store.admin_policy import AdminPolicy, parse_networks
from deepinfer.cache.store.gc import TtlPolicy, parse_ttl_spec
from deepinfer.cache.store.metrics import StorageCollector
from deepinfer.cache.store.node import StorageNode, StorageNodeConfig

DEFAULT_CAPACITY_BYTES = 10 * 1024**3


class StorageRole:
    def __init__(self, config: StorageNodeConfig):
        self.storage = StorageNode(config)

    @property
    def num_in_flight(self) -> int:
        return self.storage.num_in_flight

    async def start(self, node) -> None:
        await self.storage.start()
        node.metrics.registry.register(StorageCollector(self.storage.stats))

    async def drain(self, deadline_s: float) -> None:
        await self.storage.drain(deadline_s)

    async def stop(self) -> None:
        await self.storage.stop(drain_s=0.0)


def make_role(*, role, config, node_name: str) -> StorageRole:
    spec = config.node(node_name)
    if not spec.data:
        raise ValueError(f"storage node {node_name}: set its data address (the ROUTER that serves fragments)")
    section = config.storage
    base = getattr(section, "dir", "") or str(Path(envs.get().cache_dir) / "storage")
    capacity = getattr(section, "capacity_bytes", 0) or DEFAULT_CAPACITY_BYTES
    ttl_spec = getattr(section, "ttl", "")
    # admin messages from loopback or [storage] admin_from networks; the data ROUTER stays plain
    # even under security.curve, so engines' store clients reach it without keys
    admin = AdminPolicy(networks=parse_networks(getattr(section, "admin_from", "") or ""))
    membership_file = getattr(section, "membership_file", "") or ""
    return StorageRole(
        StorageNodeConfig(
            dir=Path(base) / node_name,
            listen=spec.data,
            capacity_bytes=int(capacity),
            ttl=parse_ttl_spec(ttl_spec) if ttl_spec else TtlPolicy(),
            name=node_name,
            admin=admin,
            membership_file=Path(membership_file) if membership_file else None,
        )
    )
