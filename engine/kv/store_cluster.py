"""The erasure-coded storage cluster an engine keeps KV blocks in: node addresses and the EC layout.

``EngineOptions.kv_store_nodes`` is one of:

    "tcp://10.0.0.7:7200,tcp://10.0.0.8:7200,..."    storage node addresses (a list works too);
    "a=tcp://10.0.0.7:7200,b=tcp://..."               ... with the names the nodes run under
    "/etc/deepinfer/members.json"                      the storage membership record (the
                                                       nodes' own --cluster file): k, m and
                                                       node states from it; the engine follows
                                                       the file as nodes join, drain or leave

A cluster config file (cluster.toml, the runtime's deployment file) is read by the runtime:
``deepinfer serve --kv-store-nodes cluster.toml`` and the node roles turn its storage nodes into
addresses and ``kv_store_ec`` before the engine sees them (runtime/kv_store_cluster.py).

Objects are placed by a rendezvous ranking over node *names* (cache/store/placement.py), so
every engine sharing a cluster must name its nodes alike: an address list names each node by
its address unless ``NAME=`` is given. k and m of an address list come from ``kv_store_ec``
("K+M", default 10+2: ARCHITECTURE.md, "KV store"); a membership record carries its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EC = (10, 2)
_ADDRESS_RE = re.compile(r"^(tcp://[^:/\s,=]+:\d{1,5}|ipc://[^\s,]+)$")
_EC_RE = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


class StoreClusterError(ValueError):
    """A storage cluster option that cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class StoreCluster:
    node2address: dict[str, str]  # node name -> address of its fragment ROUTER
    ec_k: int
    ec_m: int
    source: str  # where the list came from, for logs: "3 addresses" or the config file's path
    membership_file: str = ""  # set: a membership record (cache/store/membership.py) the store follows

    def describe(self) -> str:
        return f"{len(self.node2address)} storage nodes ({self.source}), EC {self.ec_k}+{self.ec_m}"


def parse_ec(value: str) -> tuple[int, int]:
    """"K+M" -> (k, m): k >= 1 data fragments, m >= 0 parity fragments."""
    match = _EC_RE.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < 1:
        raise StoreClusterError(f"kv_store_ec must be K+M with K >= 1 and M >= 0 (e.g. 10+2), got {value!r}")
    k, m = int(match.group(1)), int(match.group(2))
    from deepinfer.cache.store.ec import ECConfig

    try:
        ECConfig(k=k, m=m)
    except ValueError as exc:
        raise StoreClusterError(f"kv_store_ec {value!r}: {exc}") from None
    return k, m


def resolve_store_cluster(nodes: str | Sequence[str], ec: str | None = None) -> StoreCluster:
    """The cluster ``nodes`` names (see the module docstring); one-line StoreClusterError otherwise."""
    if isinstance(nodes, str):
        text = nodes.strip()
        if not text:
            raise StoreClusterError("kv_store_nodes is empty: give storage node addresses or a cluster config file")
        if "://" not in text:
            if text.endswith(".json"):
                return _from_membership_file(text, ec)
            return _from_path(text)
        entries = [e.strip() for e in text.split(",")]
    elif isinstance(nodes, Sequence) and all(isinstance(e, str) for e in nodes):
        entries = [e.strip() for e in nodes]
    else:
        raise StoreClusterError(f"kv_store_nodes must be addresses or a cluster config path, got {nodes!r}")
    k, m = DEFAULT_EC if ec is None else parse_ec(ec)
    node2address: dict[str, str] = {}
    for entry in entries:
        name, sep, address = entry.partition("=") if "=" in entry.split("://")[0] else ("", "", entry)
        name = name.strip() if sep else address
        if not _ADDRESS_RE.match(address) or not name:
            raise StoreClusterError(f"kv_store_nodes: {entry!r} is not a storage node address "
                                    "(tcp://HOST:PORT or ipc://PATH, optionally NAME=ADDRESS)")
        if name in node2address or address in node2address.values():
            raise StoreClusterError(f"kv_store_nodes: {entry!r} is listed twice")
        node2address[name] = address
    check_width(len(node2address), k, m, "kv_store_nodes lists", "give kv_store_ec K+M with K+M <= the node count")
    return StoreCluster(node2address, k, m, f"{len(node2address)} addresses")


def _from_path(path: str) -> StoreCluster:
    file = Path(path).expanduser()
    if not file.is_file():
        raise StoreClusterError(f"kv_store_nodes: {path!r} is neither storage node addresses (tcp://HOST:PORT,...) "
                                "nor an existing cluster config file")
    raise StoreClusterError(f"kv_store_nodes: {path} is a cluster config file, which deepinfer serve and deepinfer "
                            "node read; give the engine storage node addresses or a storage membership file (.json)")


def _from_membership_file(path: str, ec: str | None) -> StoreCluster:
    from deepinfer.cache.store.membership import MembershipError, load_membership

    if ec is not None:
        raise StoreClusterError(f"kv_store_ec is for an address list; {path} records k and m itself (its \"ec\")")
    try:
        record = load_membership(Path(path).expanduser())
    except MembershipError as exc:
        raise StoreClusterError(f"kv_store_nodes: {exc}") from None
    check_width(len(record.ranked_names), record.k, record.m, f"kv_store_nodes: {path} lists", "add storage nodes")
    return StoreCluster(record.node2address, record.k, record.m, path, membership_file=str(Path(path).expanduser()))


def check_width(num_nodes: int, k: int, m: int, what: str, fix: str) -> None:
    if num_nodes < k + m:
        raise StoreClusterError(f"{what} {num_nodes} storage nodes; erasure coding {k}+{m} needs at least {k + m}: "
                                f"{fix}")


def build_cluster_store(cluster: StoreCluster):
    """A ClusterStore over ``cluster`` (not started: KVOffload starts and closes it on its I/O loop)."""
    from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
    from deepinfer.cache.store.ec import ECConfig
    from deepinfer.cache.store.membership import load_membership

    config = ClusterStoreConfig(ec=ECConfig(k=cluster.ec_k, m=cluster.ec_m))
    if cluster.membership_file:
        return ClusterStore(load_membership(cluster.membership_file), config, membership_file=cluster.membership_file)
    return ClusterStore(cluster.node2address, config)
