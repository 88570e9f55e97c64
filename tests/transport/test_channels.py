"""Request/response over real ROUTER/DEALER sockets on loopback: deadlines, concurrency, drain."""

import asyncio
import random

import pytest
import uvloop
import zmq
import zmq.asyncio

from deepinfer.transport.channels import Incoming, RequestClient, RequestServer, WithBuffers
from deepinfer.transport.errors import ChannelClosed, DeadlineExceeded, RemoteError
from deepinfer.transport.protocol import (
    ErrorCode,
    Hello,
    NodeControlReply,
    NodeControlRequest,
    Role,
    StatusRequest,
    Welcome,
)

ADDR = "tcp://127.0.0.1:0"


async def echo_welcome(incoming: Incoming):
    msg = incoming.msg
    if isinstance(msg, StatusRequest):
        raise RuntimeError("status is broken on purpose")
    await asyncio.sleep(random.uniform(0, 0.02))
    return Welcome(node_name=msg.node_name.upper(), role=msg.role, instance_id=msg.instance_id + 1)


def hello(i: int) -> Hello:
    return Hello(node_name=f"node{i}", role=Role.PREFILL, instance_id=i)


async def test_request_reply_roundtrip_and_handler_error_keeps_serving():
    async with RequestServer(ADDR, NodeControlRequest, echo_welcome) as server:
        async with RequestClient(server.address, NodeControlReply) as client:
            reply = await client.request(hello(7), timeout_s=5)
            assert reply == Welcome(node_name="NODE7", role=Role.PREFILL, instance_id=8)
            with pytest.raises(RemoteError) as info:
                await client.request(StatusRequest(), timeout_s=5)
            assert info.value.code == ErrorCode.HANDLER_FAILED
            assert "broken on purpose" in str(info.value)
            assert (await client.request(hello(1), timeout_s=5)).instance_id == 2
            assert client.num_pending == 0


async def test_100_concurrent_requests_are_matched_to_their_replies():
    async with RequestServer(ADDR, NodeControlRequest, echo_welcome) as server:
        async with RequestClient(server.address, NodeControlReply) as client:
            replies = await asyncio.gather(*(client.request(hello(i), timeout_s=10) for i in range(100)))
            assert [r.node_name for r in replies] == [f"NODE{i}" for i in range(100)]
            assert [r.instance_id for r in replies] == [i + 1 for i in range(100)]
            assert client.num_pending == 0
            assert server.stats.num_received == 100 and server.stats.num_sent == 100


async def test_peer_that_never_answers_raises_deadline_and_leaks_nothing():
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.linger = 0
    silent.bind("tcp://127.0.0.1:0")
    try:
        async with RequestClient(silent.last_endpoint.decode(), NodeControlReply, ctx=ctx) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            results = await asyncio.gather(*(client.request(hello(i), timeout_s=0.2) for i in range(5)),
                                           return_exceptions=True)
            assert all(isinstance(r, DeadlineExceeded) for r in results), results
            assert results[0].code == ErrorCode.DEADLINE_EXCEEDED
            assert loop.time() - start < 2.0
            assert client.num_pending == 0
            # the silent peer did receive them: it is the answer that never came
            frames = await asyncio.wait_for(silent.recv_multipart(), 2)
            assert len(frames) == 3
    finally:
        silent.close(0)
        ctx.term()


async def test_no_server_at_all_is_a_deadline_error():
    async with RequestClient("tcp://127.0.0.1:1", NodeControlReply) as client:
        with pytest.raises(DeadlineExceeded):
            await client.request(hello(0), timeout_s=0.1)
        assert client.num_pending == 0


async def test_late_reply_after_deadline_is_dropped_and_counted():
    async def slow(incoming):
        await asyncio.sleep(0.3)
        return Welcome(node_name="late", role=Role.DECODE, instance_id=0)

    async with RequestServer(ADDR, NodeControlRequest, slow) as server:
        async with RequestClient(server.address, NodeControlReply) as client:
            with pytest.raises(DeadlineExceeded):
                await client.request(hello(0), timeout_s=0.05)
            for _ in range(100):
                if client.stats.num_late_replies:
                    break
                await asyncio.sleep(0.02)
            assert client.stats.num_late_replies == 1
            assert client.num_pending == 0


async def test_attachments_travel_with_request_and_reply():
    async def reverse(incoming: Incoming):
        payload = bytes(incoming.buffers[0])
        return WithBuffers(Welcome(node_name=str(len(payload)), role=Role.STORAGE, instance_id=0),
                           [payload[::-1], b"second"])

    payload = bytes(range(256)) * 1000
    async with RequestServer(ADDR, NodeControlRequest, reverse, max_attachment_bytes=1 << 20) as server:
        async with RequestClient(server.address, NodeControlReply) as client:
            reply, buffers = await client.request_with_buffers(hello(0), buffers=[memoryview(payload)], timeout_s=5)
            assert reply.node_name == str(len(payload))
            assert bytes(buffers[0]) == payload[::-1]
            assert bytes(buffers[1]) == b"second"


async def test_drain_finishes_in_flight_refuses_new_and_aborts_past_deadline():
    release = asyncio.Event()

    async def gated(incoming):
        if incoming.msg.node_name == "forever":
            await asyncio.sleep(3600)
        await release.wait()
        return Welcome(node_name="done", role=Role.DECODE, instance_id=0)

    async with RequestServer(ADDR, NodeControlRequest, gated) as server:
        async with RequestClient(server.address, NodeControlReply) as client:
            in_flight = asyncio.create_task(client.request(hello(1), timeout_s=10))
            stuck = asyncio.create_task(
                client.request(Hello(node_name="forever", role=Role.DECODE, instance_id=0), timeout_s=10))
            while server.num_in_flight < 2:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(server.drain(deadline_s=0.5))
            await asyncio.sleep(0.05)
            with pytest.raises(RemoteError) as info:
                await client.request(hello(2), timeout_s=5)
            assert info.value.code == ErrorCode.DRAINING
            release.set()
            assert (await in_flight).node_name == "done"
            assert await drain == 1  # the stuck one was aborted at the deadline ...
            with pytest.raises(RemoteError) as info:
                await stuck
            assert info.value.code == ErrorCode.CLOSED  # ... and told so, not left to time out
            assert server.num_in_flight == 0


async def test_close_fails_pending_requests_and_leaves_no_tasks():
    before = asyncio.all_tasks()

    async def never(incoming):
        await asyncio.sleep(3600)

    server = RequestServer(ADDR, NodeControlRequest, never)
    await server.start()
    client = await RequestClient(server.address, NodeControlReply).start()
    pending = asyncio.create_task(client.request(hello(0), timeout_s=30))
    while server.num_in_flight < 1:
        await asyncio.sleep(0.01)
    await client.close()
    with pytest.raises(ChannelClosed):
        await pending
    await server.close()
    assert client.num_pending == 0 and server.num_in_flight == 0
    assert asyncio.all_tasks() - before == set()
    with pytest.raises(ChannelClosed):
        await client.request(hello(0))


def test_channels_work_inside_a_uvloop_loop():
    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with RequestServer(ADDR, NodeControlRequest, echo_welcome) as server:
            async with RequestClient(server.address, NodeControlReply) as client:
                replies = await asyncio.gather(*(client.request(hello(i), timeout_s=5) for i in range(20)))
        return [r.instance_id for r in replies]

    assert uvloop.run(main()) == list(range(1, 21))
