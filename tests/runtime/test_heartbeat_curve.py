"""A CURVE cluster from the TOML config: nodes see each other, strangers are never answered."""

import asyncio

import pytest
import zmq.asyncio

from deepinfer.runtime.cluster_config import parse_cluster_config
from deepinfer.runtime.node import Node, NodeSettings
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import DeadlineExceeded
from deepinfer.transport.ports import free_tcp_port as free_port  # below the ephemeral range
from deepinfer.transport.protocol import Hello, NodeControlReply, PeerUp, Role, Welcome
from deepinfer.transport.security import CurveClientKeys, create_keypair_files, generate_keypair


@pytest.mark.timeout(60)
async def test_curve_cluster_nodes_find_each_other_and_refuse_strangers(tmp_path):
    keys = {name: create_keypair_files(tmp_path / "keys", name) for name in ("a", "b")}
    operator = generate_keypair()
    nodes_toml = "".join(f"""
[[nodes]]
name = "{name}"
role = "decode"
control = "tcp://127.0.0.1:{free_port()}"
events = "tcp://127.0.0.1:{free_port()}"
curve_public_key = "{keys[name].public.decode()}"
curve_secret_key_file = "{tmp_path / 'keys' / (name + '.key_secret')}"
""" for name in ("a", "b"))
    config = parse_cluster_config(f"""
[cluster]
heartbeat_interval_s = 0.1
[security]
curve = true
allow_clients = ["{operator.public.decode()}"]
{nodes_toml}""")
    contexts = [zmq.asyncio.Context(), zmq.asyncio.Context()]  # one ZAP handler per context
    a = Node(NodeSettings.from_cluster(config, "a"), ctx=contexts[0])
    b = Node(NodeSettings.from_cluster(config, "b"), ctx=contexts[1])
    await a.start()
    events = a.heartbeat.subscribe()
    await b.start()
    try:
        up = await asyncio.wait_for(events.get(), 10)
        assert isinstance(up, PeerUp) and up.instance_id == b.instance_id
        hello = Hello(node_name="op", role=Role.GATEWAY, instance_id=1)
        admitted = CurveClientKeys(operator, server_public=keys["b"].public)
        async with RequestClient(config.node("b").control, NodeControlReply, curve=admitted) as client:
            assert isinstance(await client.request(hello, timeout_s=5), Welcome)
        stranger = CurveClientKeys(generate_keypair(), server_public=keys["b"].public)
        async with RequestClient(config.node("b").control, NodeControlReply, curve=stranger) as client:
            with pytest.raises(DeadlineExceeded):
                await client.request(hello, timeout_s=0.5)
        async with RequestClient(config.node("b").control, NodeControlReply) as plain:
            with pytest.raises(DeadlineExceeded):
                await plain.request(hello, timeout_s=0.5)
    finally:
        await b.stop()
        await a.stop()
        for ctx in contexts:
            ctx.term()


def test_curve_config_without_a_secret_key_file_is_a_clear_error():
    key = generate_keypair().public.decode()
    config = parse_cluster_config(f"""
[security]
curve = true
[[nodes]]
name = "a"
role = "decode"
control = "tcp://127.0.0.1:1"
events = "tcp://127.0.0.1:2"
curve_public_key = "{key}"
""")
    with pytest.raises(ValueError, match="node a: security.curve is on but curve_secret_key_file is not set"):
        NodeSettings.from_cluster(config, "a")
