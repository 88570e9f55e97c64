"""A cluster config file as the storage cluster of `deepinfer serve --kv-store-nodes` (the runtime reads
the file; the engine gets its storage nodes as addresses and kv_store_ec): the nodes it names, the
one-line errors for files that cannot serve, and an engine told the file directly refusing it.

Moved from tests/engine/test_kv_store_option.py when cluster-file parsing moved to the runtime
(runtime/kv_store_cluster.py); the same expectations, reached through the runtime's resolver."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.engine.core.options import EngineOptions, EngineOptionsError
from deepinfer.runtime.kv_store_cluster import engine_store_options, kv_store_cluster

CONFIG = """
[storage]
ec_k = 2
ec_m = 1
{nodes}
"""
NODE = """
[[nodes]]
name = "{name}"
role = "{role}"
control = "tcp://127.0.0.1:{p0}"
events = "tcp://127.0.0.1:{p1}"
{data}
"""


def _config(tmp_path, roles_with_data) -> Path:
    nodes = "".join(NODE.format(name=f"n{i}", role=role, p0=9000 + 3 * i, p1=9001 + 3 * i,
                                data=f'data = "tcp://127.0.0.1:{9002 + 3 * i}"' if has_data else "")
                    for i, (role, has_data) in enumerate(roles_with_data))
    path = tmp_path / "cluster.toml"
    path.write_text(CONFIG.format(nodes=nodes))
    return path


def test_cluster_config_file_names_the_storage_nodes(tmp_path):
    path = _config(tmp_path, [("gateway", False), ("storage", True), ("storage", True), ("storage", True)])
    cluster = kv_store_cluster(dict(kv_store_nodes=str(path)))
    assert cluster.node2address == {f"n{i}": f"tcp://127.0.0.1:{9002 + 3 * i}" for i in (1, 2, 3)}
    assert (cluster.ec_k, cluster.ec_m) == (2, 1)
    with pytest.raises(EngineOptionsError, match="kv_store_ec is for an address list"):
        kv_store_cluster(dict(kv_store_nodes=str(path), kv_store_ec="2+1"))
    short = _config(tmp_path, [("storage", True), ("storage", True), ("decode", False)])
    with pytest.raises(EngineOptionsError, match="ec_k.*ec_m|needs at least 3"):
        kv_store_cluster(dict(kv_store_nodes=str(short)))
    none = _config(tmp_path, [("gateway", False)])
    with pytest.raises(EngineOptionsError, match="no node with role"):
        kv_store_cluster(dict(kv_store_nodes=str(none)))
    # addresses with names, and the list form of the Python API
    named = kv_store_cluster(dict(kv_store_nodes="a=tcp://h1:1, b=tcp://h2:1", kv_store_ec="1+1"))
    assert named.node2address == {"a": "tcp://h1:1", "b": "tcp://h2:1"}
    listed = kv_store_cluster(dict(kv_store_nodes=["tcp://h1:1", "tcp://h2:1"], kv_store_ec="2+0"))
    assert listed.node2address == {"tcp://h1:1": "tcp://h1:1", "tcp://h2:1": "tcp://h2:1"}


def test_the_engine_is_given_addresses_not_the_file(tmp_path):
    path = _config(tmp_path, [("storage", True), ("storage", True), ("storage", True)])
    options = engine_store_options(dict(kv_store_nodes=str(path), num_blocks=8))
    assert options == dict(kv_store_nodes="n0=tcp://127.0.0.1:9002,n1=tcp://127.0.0.1:9005,n2=tcp://127.0.0.1:9008",
                           kv_store_ec="2+1", num_blocks=8)
    assert EngineOptions(**options).kv_store_nodes == options["kv_store_nodes"]
    with pytest.raises(EngineOptionsError, match="is a cluster config file, which deepinfer serve and deepinfer node read"):
        EngineOptions(kv_store_nodes=str(path))
