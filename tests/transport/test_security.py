"""CURVE: authenticated peers talk, everybody else never reaches the handler nor gets a reply."""

import asyncio

import pytest
import zmq.asyncio

from deepinfer.transport.channels import EventPublisher, EventSubscriber, RequestClient, RequestServer
from deepinfer.transport.errors import DeadlineExceeded
from deepinfer.transport.protocol import (
    Heartbeat,
    Hello,
    NodeControlReply,
    NodeControlRequest,
    PeerEvent,
    Role,
    Welcome,
)
from deepinfer.transport.security import (
    ClientAllowList,
    CurveClientKeys,
    CurveServerKeys,
    create_keypair_files,
    generate_keypair,
    load_keypair,
    load_public_key,
)

HELLO = Hello(node_name="c", role=Role.GATEWAY, instance_id=1)


async def welcome(incoming):
    return Welcome(node_name="s", role=Role.STORAGE, instance_id=2)


@pytest.fixture
def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.term()


def test_keypairs_are_z85_and_files_round_trip(tmp_path):
    pair = generate_keypair()
    assert len(pair.public) == 40 and len(pair.secret) == 40 and pair.public != pair.secret
    assert "secret" not in repr(pair) or pair.secret.decode() not in repr(pair)
    written = create_keypair_files(tmp_path / "keys", "node0")
    assert load_keypair(tmp_path / "keys" / "node0.key_secret") == written
    assert load_public_key(tmp_path / "keys" / "node0.key") == written.public
    with pytest.raises(ValueError, match="only a public key"):
        load_keypair(tmp_path / "keys" / "node0.key")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_keypair(tmp_path / "missing.key_secret")


async def test_curve_client_with_the_server_key_is_served_others_never_reach_it(ctx):
    server_keys = generate_keypair()
    async with RequestServer("tcp://127.0.0.1:0", NodeControlRequest, welcome, ctx=ctx,
                             curve=CurveServerKeys(server_keys)) as server:
        good = CurveClientKeys(generate_keypair(), server_public=server_keys.public)
        async with RequestClient(server.address, NodeControlReply, ctx=ctx, curve=good) as client:
            assert (await client.request(HELLO, timeout_s=5)).node_name == "s"
        received_by_good = server.stats.num_received
        async with RequestClient(server.address, NodeControlReply, ctx=ctx) as plain:
            with pytest.raises(DeadlineExceeded):
                await plain.request(HELLO, timeout_s=0.5)
        wrong = CurveClientKeys(generate_keypair(), server_public=generate_keypair().public)
        async with RequestClient(server.address, NodeControlReply, ctx=ctx, curve=wrong) as impostor:
            with pytest.raises(DeadlineExceeded):
                await impostor.request(HELLO, timeout_s=0.5)
        assert server.stats.num_received == received_by_good == 1


async def test_allow_list_admits_only_listed_client_keys(ctx):
    server_keys, allowed, stranger = generate_keypair(), generate_keypair(), generate_keypair()
    allow_list = ClientAllowList(ctx, [allowed.public])
    await allow_list.start()
    try:
        async with RequestServer("tcp://127.0.0.1:0", NodeControlRequest, welcome, ctx=ctx,
                                 curve=CurveServerKeys(server_keys)) as server:
            ok = CurveClientKeys(allowed, server_public=server_keys.public)
            async with RequestClient(server.address, NodeControlReply, ctx=ctx, curve=ok) as client:
                assert (await client.request(HELLO, timeout_s=5)).node_name == "s"
            refused = CurveClientKeys(stranger, server_public=server_keys.public)
            async with RequestClient(server.address, NodeControlReply, ctx=ctx, curve=refused) as client:
                with pytest.raises(DeadlineExceeded):
                    await client.request(HELLO, timeout_s=0.5)
            assert server.stats.num_received == 1
            allow_list.allow(stranger.public)  # admitted from its next connection on
            async with RequestClient(server.address, NodeControlReply, ctx=ctx, curve=refused) as client:
                assert (await client.request(HELLO, timeout_s=5)).node_name == "s"
    finally:
        allow_list.stop()


async def test_subscriber_reaches_publishers_with_different_server_keys(ctx):
    keys_a, keys_b, own = generate_keypair(), generate_keypair(), generate_keypair()
    async with EventPublisher("tcp://127.0.0.1:0", ctx=ctx, curve=CurveServerKeys(keys_a)) as pub_a, \
            EventPublisher("tcp://127.0.0.1:0", ctx=ctx, curve=CurveServerKeys(keys_b)) as pub_b, \
            EventSubscriber(PeerEvent, ctx=ctx, curve_keypair=own) as sub:
        sub.connect(pub_a.address, server_public=keys_a.public)
        sub.connect(pub_b.address, server_public=keys_b.public)
        with pytest.raises(ValueError, match="needs its CURVE public key"):
            sub.connect("tcp://127.0.0.1:1")
        seen = set()
        for seq in range(300):
            await pub_a.publish(b"hb", Heartbeat(node_name="a", role=Role.DECODE, instance_id=1, seq=seq))
            await pub_b.publish(b"hb", Heartbeat(node_name="b", role=Role.DECODE, instance_id=2, seq=seq))
            try:
                while True:
                    _, beat = await asyncio.wait_for(sub.recv(), 0.01)
                    seen.add(beat.node_name)
            except TimeoutError:
                pass
            if seen == {"a", "b"}:
                break
        assert seen == {"a", "b"}
