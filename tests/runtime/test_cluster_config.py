"""Cluster TOML: valid configs load, every kind of mistake is one line naming the key."""

import pytest

from deepinfer.runtime.cluster_config import ClusterConfigError, NodeRole, load_cluster_config, parse_cluster_config
from deepinfer.transport.protocol import Role
from deepinfer.transport.security import generate_keypair

GOOD = """
[cluster]
name = "test"
heartbeat_interval_s = 0.25
missed_beats = 4

[storage]
ec_k = 2
ec_m = 1

[[nodes]]
name = "gw"
role = "gateway"
control = "tcp://127.0.0.1:7000"
events = "tcp://127.0.0.1:7001"

[[nodes]]
name = "p0"
role = "prefill"
control = "ipc:///tmp/p0-control"
events = "ipc:///tmp/p0-events"
data = "ipc:///tmp/p0-data"
""" + "".join(f"""
[[nodes]]
name = "s{i}"
role = "storage"
control = "tcp://127.0.0.1:{7100 + 2 * i}"
events = "tcp://127.0.0.1:{7101 + 2 * i}"
""" for i in range(3))


def test_good_config_loads_with_defaults_and_lookups(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(GOOD)
    config = load_cluster_config(path)
    assert config.cluster.name == "test"
    assert config.cluster.down_after_s == pytest.approx(1.0)
    assert config.cluster.drain_deadline_s == 30.0  # default
    assert (config.storage.ec_k, config.storage.ec_m) == (2, 1)
    assert config.node("p0").data == "ipc:///tmp/p0-data"
    assert config.node("p0").role is NodeRole.PREFILL and config.node("p0").role.wire is Role.PREFILL
    assert [n.name for n in config.nodes_with_role("storage")] == ["s0", "s1", "s2"]
    assert [n.name for n in config.peers_of("gw")] == ["p0", "s0", "s1", "s2"]
    with pytest.raises(KeyError, match="no node named 'zz'"):
        config.node("zz")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('role = "prefill"', 'role = "prefil"'),
     "cluster.toml: nodes[1].role: expected one of gateway, encoder, prefill, decode, storage, got 'prefil'"),
    (lambda t: t.replace("missed_beats = 4", "missed_beats = 0"), "cluster.toml: cluster.missed_beats: expected `int` >= 1"),
    (lambda t: t.replace("missed_beats = 4", 'missed_beats = "4"'), "cluster.missed_beats: expected `int`, got `str`"),
    (lambda t: t.replace("heartbeat_interval_s = 0.25", "heartbeat_interval_s = 0"), "cluster.heartbeat_interval_s: expected `float` > 0"),
    (lambda t: t.replace('name = "test"', 'name = "test"\nheartbeat = 1'), "cluster.heartbeat: unknown key"),
    (lambda t: t.replace('data = "ipc:///tmp/p0-data"', 'dta = "ipc:///tmp/p0-data"'), "nodes[1].dta: unknown key"),
    (lambda t: t.replace('name = "p0"\n', ""), "nodes[1].name: required key is missing"),
    (lambda t: t.replace('name = "s2"', 'name = "s0"'), "nodes[4].name: duplicate node name 's0' (also nodes[2])"),
    (lambda t: t.replace("tcp://127.0.0.1:7001", "127.0.0.1:7001"),
     "nodes[0].events: expected tcp://HOST:PORT or ipc://PATH, got '127.0.0.1:7001'"),
    (lambda t: t.replace("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7000"),
     "nodes[0].events: address tcp://127.0.0.1:7000 is already used by nodes[0].control"),
    (lambda t: t.replace("ec_k = 2", "ec_k = 10"), "storage: ec_k + ec_m = 11 needs at least 11 storage nodes"),
    (lambda t: t.replace("ec_m = 1", "ec_m = -1"), "storage.ec_m: expected `int` >= 0"),
    (lambda t: t + "\n[security]\ncurve = true\n", "nodes[0].curve_public_key: a 40-character Z85 key is required"),
    (lambda t: t + "\n[security]\nallow_clients = ['short']\n", "security.allow_clients[0]: expected a 40-character"),
    (lambda t: t + "\n[[nodes]\n", "cluster.toml: not valid TOML"),
    (lambda t: "[cluster]\nname = 'x'\n", "cluster.toml: nodes: required key is missing"),
    (lambda t: "nodes = []\n", "cluster.toml: nodes: expected `array` of length >= 1"),
])
def test_each_mistake_is_one_line_naming_the_key(edit, message):
    with pytest.raises(ClusterConfigError) as info:
        parse_cluster_config(edit(GOOD))
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text


def test_curve_config_with_keys_is_accepted():
    keys = [generate_keypair().public.decode() for _ in range(5)]
    text = GOOD + "\n[security]\ncurve = true\n"
    for i, name in enumerate(["gw", "p0", "s0", "s1", "s2"]):
        text = text.replace(f'name = "{name}"\n', f'name = "{name}"\ncurve_public_key = "{keys[i]}"\n', 1)
    config = parse_cluster_config(text)
    assert config.security.curve and config.node("s1").curve_public_key == keys[3]


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ClusterConfigError, match=r"nope.toml: cannot read the cluster config: No such file"):
        load_cluster_config(tmp_path / "nope.toml")
