"""Bad frames never crash a receiver, never get unpickled, and are answered where possible."""

import asyncio
import pickle
import struct

import msgspec
import pytest
import zmq
import zmq.asyncio

from deepinfer.transport.channels import (
    EventPublisher,
    EventSubscriber,
    RequestClient,
    RequestServer,
    StreamReceiver,
    StreamSender,
)
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import MalformedFrame, OversizedFrame, UnexpectedMessage
from deepinfer.transport.protocol import (
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Hello,
    NodeControlReply,
    NodeControlRequest,
    PeerEvent,
    Role,
    Welcome,
)

RID = struct.Struct("<Q")
LIMIT = 4096


class Boom:
    """Unpickling this would create a file: proof that nobody unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_codec_maps_each_kind_of_bad_frame_to_a_typed_error():
    codec = Codec(NodeControlRequest, max_frame_bytes=LIMIT)
    good = Hello(node_name="a", role=Role.GATEWAY, instance_id=3)
    assert codec.decode(codec.encode(good)) == good
    with pytest.raises(MalformedFrame):
        codec.decode(b"\xc1\xc1")
    with pytest.raises(UnexpectedMessage):  # a message of another channel
        codec.decode(codec.encode(Heartbeat(node_name="a", role=Role.GATEWAY, instance_id=1, seq=1)))
    with pytest.raises(UnexpectedMessage):  # right tag, wrong field type
        codec.decode(msgspec.msgpack.encode(["Hello", "a", 99, 3]))
    with pytest.raises(OversizedFrame):
        codec.decode(b"\x90" * (LIMIT + 1))


@pytest.fixture
async def server_and_raw_dealer():
    async def handler(incoming):
        return Welcome(node_name=incoming.msg.node_name, role=Role.GATEWAY, instance_id=0)

    ctx = zmq.asyncio.Context()
    server = RequestServer("tcp://127.0.0.1:0", NodeControlRequest, handler, ctx=ctx, max_frame_bytes=LIMIT)
    await server.start()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(server.address)
    try:
        yield server, raw, ctx
    finally:
        raw.close(0)
        await server.close()
        ctx.term()


async def ask_raw(raw, frames) -> list[bytes]:
    await raw.send_multipart(frames)
    return await asyncio.wait_for(raw.recv_multipart(), 5)


async def test_server_answers_bad_requests_with_typed_errors_and_keeps_serving(server_and_raw_dealer, tmp_path):
    server, raw, ctx = server_and_raw_dealer
    errors = Codec(ErrorReply)
    marker = tmp_path / "unpickled"
    bad_bodies = {
        b"\xc1 not msgpack": ErrorCode.MALFORMED,
        pickle.dumps(Boom(str(marker))): ErrorCode.UNEXPECTED_MESSAGE,  # 0x80 reads as an empty msgpack map
        Codec(PeerEvent).encode(Heartbeat(node_name="x", role=Role.DECODE, instance_id=1, seq=2)):
            ErrorCode.UNEXPECTED_MESSAGE,
        b"\x90" * (LIMIT + 1): ErrorCode.OVERSIZED,
    }
    for i, (body, code) in enumerate(bad_bodies.items(), start=1):
        rid, reply = await ask_raw(raw, [RID.pack(i), body])
        assert RID.unpack(rid) == (i,)
        assert errors.decode(reply).code == code
    # wrong number of frames / bad envelope: answered with request id 0
    rid, reply = await ask_raw(raw, [b"only-one-frame"])
    assert rid == RID.pack(0) and errors.decode(reply).code == ErrorCode.MALFORMED
    assert not marker.exists()
    assert server.stats.num_dropped == 5
    assert server.stats.dropped_by_code == {
        ErrorCode.MALFORMED: 2, ErrorCode.UNEXPECTED_MESSAGE: 2, ErrorCode.OVERSIZED: 1}
    # the receiver still serves a well-formed request from a real client afterwards
    async with RequestClient(server.address, NodeControlReply, ctx=ctx) as client:
        reply = await client.request(Hello(node_name="ok", role=Role.GATEWAY, instance_id=1), timeout_s=5)
        assert reply.node_name == "ok"


async def test_frame_beyond_the_hard_limit_is_cut_off_by_libzmq_and_server_survives(server_and_raw_dealer):
    server, raw, ctx = server_and_raw_dealer
    await raw.send_multipart([RID.pack(1), b"\x90" * (LIMIT * 8)])
    await asyncio.sleep(0.2)
    assert server.stats.num_received == 0  # never buffered nor handed to Python
    async with RequestClient(server.address, NodeControlReply, ctx=ctx) as client:
        reply = await client.request(Hello(node_name="after", role=Role.GATEWAY, instance_id=1), timeout_s=5)
        assert reply.node_name == "after"


async def test_stream_receiver_skips_bad_frames_and_delivers_the_next_good_one():
    async with StreamReceiver("tcp://127.0.0.1:0", PeerEvent, max_frame_bytes=LIMIT) as receiver:
        ctx = zmq.asyncio.Context.instance()
        raw = ctx.socket(zmq.PUSH)
        raw.linger = 0
        raw.connect(receiver.address)
        try:
            await raw.send(b"\xc1")
            await raw.send(pickle.dumps({"x": 1}))
            await raw.send(b"\x90" * (LIMIT + 1))
            events = Codec(PeerEvent)
            await raw.send_multipart([events.encode(Hello(node_name="n", role=Role.GATEWAY, instance_id=1))])
            await raw.send_multipart([b"\x90", b"x" * (LIMIT + 1)])  # oversized attachment
            first = Heartbeat(node_name="n", role=Role.GATEWAY, instance_id=1, seq=1)
            await raw.send_multipart([events.encode(first)])
            msg, buffers = await asyncio.wait_for(receiver.recv(), 5)
            assert msg == first and buffers == []
            assert receiver.stats.num_dropped == 5
            assert receiver.stats.dropped_by_code == {
                ErrorCode.MALFORMED: 1, ErrorCode.OVERSIZED: 2, ErrorCode.UNEXPECTED_MESSAGE: 2}
            async with StreamSender(receiver.address) as sender:
                good = Heartbeat(node_name="n", role=Role.GATEWAY, instance_id=1, seq=9)
                await sender.send(good, buffers=[b"payload"])
                msg, buffers = await asyncio.wait_for(receiver.recv(), 5)
            assert msg == good and bytes(buffers[0]) == b"payload"
        finally:
            raw.close(0)


async def test_subscriber_skips_bad_events_and_filters_topics():
    async with EventPublisher("tcp://127.0.0.1:0") as pub:
        async with EventSubscriber(PeerEvent, topics=[b"hb"]) as sub:
            sub.connect(pub.address)
            beat = Heartbeat(node_name="p", role=Role.STORAGE, instance_id=5, seq=1)
            # PUB/SUB joins asynchronously: publish until the subscription is live
            for _ in range(200):
                await pub.publish(b"other", beat)
                await pub._sock.send_multipart([b"hb", b"\xc1"])
                await pub._sock.send_multipart([b"hb"])
                await pub.publish(b"hb", beat)
                try:
                    topic, msg = await asyncio.wait_for(sub.recv(), 0.05)
                    break
                except TimeoutError:
                    continue
            assert (topic, msg) == (b"hb", beat)
            assert sub.stats.num_dropped >= 2
            assert set(sub.stats.dropped_by_code) == {ErrorCode.MALFORMED}
