"""The storage cluster a cluster config file names, turned into what an engine takes.

The engine takes storage node addresses (or a membership file) and ``kv_store_ec``
(engine/kv/store_cluster.py); a cluster config file is the runtime's (runtime/cluster_config.py).
``deepinfer serve --kv-store-nodes`` accepts both, and ``DEEPINFER_KV_STORE_NODES`` may name a
file too: ``engine_store_options`` resolves a file into its ``role = "storage"`` nodes (by their
``name`` keys, at their data addresses) with k and m from its ``[storage]`` section, before the
options reach the engine; ``kv_store_cluster`` is the cluster those options give.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.engine.core.options import EngineOptions, EngineOptionsError
from deepinfer.engine.core.options import kv_store_cluster as engine_kv_store_cluster
from deepinfer.engine.kv.store_cluster import StoreCluster, StoreClusterError, check_width
from deepinfer.runtime.cluster_config import ClusterConfig, ClusterConfigError, NodeRole, load_cluster_config


def is_cluster_config(nodes: Any) -> bool:
    """``kv_store_nodes`` names a file that is not a storage membership record."""
    return isinstance(nodes, str) and "://" not in nodes and bool(nodes.strip()) and not nodes.strip().endswith(".json")


def engine_store_of(config: ClusterConfig, source: str = "cluster.toml") -> dict[str, str]:
    """EngineOptions fields (``kv_store_nodes``, ``kv_store_ec``) that put an engine on the storage
    nodes of an already parsed cluster config: its membership file when ``[storage]`` names one
    (the engine then follows membership changes), else the nodes' data addresses; {} when the
    config lists no storage node or ``[engine] kv_store = false``."""
    specs = config.nodes_with_role(NodeRole.STORAGE)
    if not specs or not config.engine.kv_store:
        return {}
    if config.storage.membership_file:
        return {"kv_store_nodes": config.storage.membership_file}
    missing = [s.name for s in specs if not s.data]
    if missing:
        raise StoreClusterError(f"{source}: storage node {missing[0]} has no data address "
                                "(the address it serves fragments on)")
    return {"kv_store_nodes": ",".join(f"{s.name}={s.data}" for s in specs),
            "kv_store_ec": f"{config.storage.ec_k}+{config.storage.ec_m}"}


def store_cluster_from_config(path: str, ec: str | None = None) -> StoreCluster:
    """The storage nodes and EC layout of a cluster config file; one-line StoreClusterError otherwise."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise StoreClusterError(f"kv_store_nodes: {path!r} is neither storage node addresses (tcp://HOST:PORT,...) "
                                "nor an existing cluster config file")
    if ec is not None:
        raise StoreClusterError(f"kv_store_ec is for an address list; {path} sets k and m in its [storage] section")
    try:
        config = load_cluster_config(file)
    except ClusterConfigError as exc:
        raise StoreClusterError(f"kv_store_nodes: {exc}") from None
    specs = config.nodes_with_role(NodeRole.STORAGE)
    if not specs:
        raise StoreClusterError(f"kv_store_nodes: {path} lists no node with role = \"storage\"")
    missing = [s.name for s in specs if not s.data]
    if missing:
        raise StoreClusterError(f"kv_store_nodes: {path}: storage node {missing[0]} has no data address "
                                "(the address it serves fragments on)")
    k, m = config.storage.ec_k, config.storage.ec_m
    check_width(len(specs), k, m, f"kv_store_nodes: {path} lists", "lower ec_k/ec_m in its [storage] section")
    return StoreCluster({s.name: s.data for s in specs}, k, m, str(file))


def engine_store_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (EngineOptions fields) with a cluster config file, given or named by
    DEEPINFER_KV_STORE_NODES, replaced by its storage nodes as ``NAME=ADDRESS,...`` and
    ``kv_store_ec`` ``K+M``; unchanged otherwise. EngineOptionsError (one line) for a bad file."""
    out = dict(options)
    nodes, ec = out.get("kv_store_nodes"), out.get("kv_store_ec")
    if nodes is None and not out.get("kv_store_dir"):
        env_nodes = envs.get().kv_store_nodes
        if is_cluster_config(env_nodes):
            nodes = env_nodes
    if not is_cluster_config(nodes):
        return out
    try:
        cluster = store_cluster_from_config(nodes, ec)
    except StoreClusterError as exc:
        raise EngineOptionsError(str(exc)) from None
    out["kv_store_nodes"] = ",".join(f"{name}={address}" for name, address in cluster.node2address.items())
    out["kv_store_ec"] = f"{cluster.ec_k}+{cluster.ec_m}"
    return out


def kv_store_cluster(options: Mapping[str, Any]) -> StoreCluster | None:
    """The storage cluster ``options`` (EngineOptions fields, or DEEPINFER_KV_STORE_NODES / _EC)
    name, a cluster config file included; None: no cluster."""
    return engine_kv_store_cluster(EngineOptions.from_kwargs(**engine_store_options(options)))
