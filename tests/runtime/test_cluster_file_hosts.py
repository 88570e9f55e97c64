"""The cluster file's hosts, buildings, [engine] / [gateway] sections and the new [storage] keys:
they load, older files still load unchanged, and each mistake is one line naming the key."""

import pytest

from deepinfer.runtime.cluster_config import ClusterConfigError, parse_cluster_config


def node(name: str, role: str, n: int, **extra) -> str:
    lines = ["[[nodes]]", f'name = "{name}"', f'role = "{role}"', f'control = "tcp://10.0.0.{n}:7100"',
             f'events = "tcp://10.0.0.{n}:7101"']
    lines += [f'{k} = "{v}"' for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def cluster(*, gateway: str = "", engine: str = "", storage: str = "") -> str:
    return "\n".join([
        "[storage]\nec_k = 1\nec_m = 1\n" + storage,
        "[engine]\n" + engine,
        "[gateway]\n" + gateway,
        node("gw", "gateway", 1, building="A", data="tcp://10.0.0.1:7102", http="http://10.0.0.1:8000"),
        node("gw-rr", "gateway", 1, host="gw", building="A", data="tcp://10.0.0.1:7202",
             http="http://10.0.0.1:8001", routing="round-robin"),
        node("p0", "prefill", 2, building="A", engine="tcp://10.0.0.2:7103", metrics="http://10.0.0.2:7104"),
        node("d1", "decode", 3, building="B", engine="tcp://10.0.0.3:7103", data="tcp://10.0.0.3:7102"),
        node("s0a", "storage", 4, host="s0", building="B", data="tcp://10.0.0.4:7102"),
        node("s0b", "storage", 5, host="s0", building="B", data="tcp://10.0.0.4:7202"),
    ]).replace('"tcp://10.0.0.1:7100"\nevents = "tcp://10.0.0.1:7101"\nhost = "gw"',
               '"tcp://10.0.0.1:7200"\nevents = "tcp://10.0.0.1:7201"\nhost = "gw"')


def test_hosts_buildings_and_sections_load():
    config = parse_cluster_config(cluster(gateway='routing = "affinity-only"\ntraffic_class = "agent"',
                                          engine='model = "/m"\nblock_size = 16\nkv_store = false\nquantization = "fp8"\n'
                                                 'speculative = "dspark"\nspec_schedule = "fixed"',
                                          storage='ttl = "agent=3d,chat=7d"\nmembership_file = "/etc/m.json"\n'
                                                  'admin_from = "10.0.0.0/8"'))
    assert config.hosts() == ["gw", "p0", "d1", "s0"]
    assert [s.name for s in config.nodes_on_host("gw")] == ["gw", "gw-rr"]
    assert [s.name for s in config.nodes_on_host("s0")] == ["s0a", "s0b"]
    assert config.building_of("d1") == "B" and config.building_of("gw-rr") == "A"
    assert config.routing_of("gw") == "affinity-only" and config.routing_of("gw-rr") == "round-robin"
    assert config.engine.options() == {"block_size": 16, "quantization": "fp8", "speculative": "dspark",
                                       "spec_schedule": "fixed"}
    assert config.engine.model == "/m" and not config.engine.kv_store
    assert config.gateway.traffic_class == "agent"
    assert config.storage.membership_file == "/etc/m.json" and config.storage.admin_from == "10.0.0.0/8"
    with pytest.raises(KeyError, match="no node runs on host 'zz'"):
        config.nodes_on_host("zz")


def test_a_file_without_the_new_keys_keeps_its_meaning():
    config = parse_cluster_config(node("a", "gateway", 1) + node("b", "prefill", 2))
    assert config.hosts() == ["a", "b"]  # every node a host of its own
    assert config.gateway.routing == "tiered" and config.engine.kv_store and config.engine.options() == {}


@pytest.mark.parametrize("text, message", [
    (cluster(gateway='routing = "random"'), "gateway.routing: expected one of tiered, round-robin, affinity-only"),
    (cluster(gateway='failure_policy = "retry"'), "gateway.failure_policy: expected recompute or fail"),
    (cluster(gateway='traffic_class = "Bulk Data"'), "gateway.traffic_class: expected a class name"),
    (cluster(gateway='traffic_class = "bulk"', storage='ttl = "agent=3d,chat=7d"'),
     "gateway.traffic_class: 'bulk' is not a TTL class of storage.ttl"),
    (cluster(storage='ttl = "agent=forever"'), "storage.ttl: "),
    (cluster(storage='admin_from = "not-a-net"'), "storage.admin_from: "),
    (cluster(engine='dtype = "fp7"'), "engine.dtype: expected auto, float32"),
    (cluster(engine="num_blocks = -1"), "engine.num_blocks: expected `int` >= 0"),
    (cluster(engine='quantization = "int4"'), "engine.quantization: expected fp8 or nothing, got 'int4'"),
    (cluster(engine='speculative = "eagle"'), "engine.speculative: expected dspark, off or nothing, got 'eagle'"),
    (cluster(engine='spec_schedule = "greedy"'), "engine.spec_schedule: expected confidence, throughput, fixed"),
    (cluster(engine="num_draft_tokens = -2"), "engine.num_draft_tokens: expected `int` >= 0"),
    (cluster().replace('host = "s0"\nbuilding = "B"\ndata = "tcp://10.0.0.4:7202"',
                       'host = "s0"\nbuilding = "A"\ndata = "tcp://10.0.0.4:7202"'),
     "nodes[5].building: host 's0' is in building 'B' (nodes[4]), not 'A'"),
    (cluster().replace('metrics = "http://10.0.0.2:7104"', 'metrics = "10.0.0.2:7104"'),
     "nodes[2].metrics: expected http://HOST:PORT, got '10.0.0.2:7104'"),
    (cluster().replace('http = "http://10.0.0.1:8001"', 'http = "http://10.0.0.1:8000"'),
     "nodes[1].http: address http://10.0.0.1:8000 is already used by nodes[0].http"),
    (cluster().replace('routing = "round-robin"', 'routing = "fastest"'), "nodes[1].routing: expected one of"),
    (cluster() + 'http = "http://10.0.0.9:1"\n', "nodes[5].http: only a gateway node serves HTTP"),
])
def test_each_mistake_names_its_key(text, message):
    with pytest.raises(ClusterConfigError) as info:
        parse_cluster_config(text)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
