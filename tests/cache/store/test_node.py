"""One storage node in-process (StorageNode) and as the `deepinfer storage` command."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from deepinfer.bin.storage import parse_size
from deepinfer.bin.cli import CliError
from deepinfer.cache.store.ec import ErasureCodec
from deepinfer.cache.store.node import RateMeter, StorageNode, StorageNodeConfig
from deepinfer.cache.store.metrics import registry_for, serve_metrics
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import RemoteError
from deepinfer.transport.protocol import (
    DebugSet,
    ErrorCode,
    FragmentMeta,
    FragmentsReply,
    FragmentStatus,
    GetFragments,
    PutAck,
    PutFragments,
    StorageReply,
    StorageStatsRequest,
    TouchFragments,
)


def _meta(frag, write_id=1):
    h = frag.header
    return FragmentMeta(h.key, h.index, h.k, h.m, h.object_size, h.payload_crc, write_id)


@pytest.fixture
async def node_and_client(tmp_path):
    node = StorageNode(StorageNodeConfig(dir=tmp_path / "n", listen="tcp://127.0.0.1:0", capacity_bytes=1 << 20, name="n0"))
    address = await node.start()
    client = await RequestClient(address, StorageReply).start()
    try:
        yield node, client
    finally:
        await client.close()
        await node.stop()


async def test_put_get_touch_stats_over_the_wire(node_and_client):
    node, client = node_and_client
    frags = ErasureCodec().encode(b"obj", os.urandom(30_000))
    ack = await client.request(PutFragments("agent", [_meta(frags[4])]), buffers=[frags[4].payload])
    assert ack == PutAck([FragmentStatus.OK])
    reply, buffers = await client.request_with_buffers(GetFragments([b"obj", b"absent"]))
    assert isinstance(reply, FragmentsReply)
    assert reply.statuses == [FragmentStatus.OK, FragmentStatus.NOT_FOUND]
    assert reply.fragments == [_meta(frags[4])] and bytes(buffers[0]) == frags[4].payload
    assert (await client.request(TouchFragments([b"obj", b"absent"]))).num_touched == 1
    stats = await client.request(StorageStatsRequest())
    assert (stats.node_name, stats.num_fragments, stats.num_puts, stats.num_hits, stats.num_misses) == ("n0", 1, 1, 1, 1)
    assert stats.num_bytes_read == stats.num_bytes_written == len(frags[4].payload)


async def test_bad_writes_are_refused_not_stored(node_and_client):
    node, client = node_and_client
    frag = ErasureCodec().encode(b"obj", os.urandom(1000))[0]
    with pytest.raises(RemoteError) as err:  # two metas, one payload
        await client.request(PutFragments("chat", [_meta(frag), _meta(frag)]), buffers=[frag.payload])
    assert err.value.code == ErrorCode.MALFORMED
    damaged = bytearray(frag.payload)
    damaged[0] ^= 1
    ack = await client.request(PutFragments("chat", [_meta(frag)]), buffers=[bytes(damaged)])
    assert ack.statuses == [FragmentStatus.INVALID]
    with pytest.raises(RemoteError, match="--debug-hooks"):
        await client.request(DebugSet(now=1.0))
    assert node.store.num_fragments == 0


async def test_prometheus_metrics_endpoint(node_and_client, port):
    import aiohttp

    node, client = node_and_client
    frag = ErasureCodec().encode(b"obj", os.urandom(2000))[0]
    await client.request(PutFragments("chat", [_meta(frag)]), buffers=[frag.payload])
    runner = await serve_metrics(registry_for(node.stats), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
    finally:
        await runner.cleanup()
    assert 'deepinfer_storage_fragments{node="n0"} 1.0' in text
    assert 'deepinfer_storage_puts_total{node="n0"} 1.0' in text
    for name in ("evictions", "expirations", "corrupt_fragments", "read_gbps", "write_gbps", "used_bytes"):
        assert f"deepinfer_storage_{name}" in text


def test_rate_meter():
    meter = RateMeter(window=2)
    for t, b in [(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 600)]:
        meter.sample(b, now=t)
    assert meter.rate() == 250.0  # (600 - 100) / 2 s over the last window


def test_parse_size():
    assert parse_size("10GiB") == 10 * 1024**3
    assert parse_size("500GB") == 500 * 10**9
    assert parse_size("1.5k") == 1500
    assert parse_size("4096") == 4096
    with pytest.raises(CliError, match="not a size"):
        parse_size("lots")


def test_storage_command_serves_and_stops_on_sigterm(tmp_path):
    cmd = [sys.executable, "-m", "deepinfer.bin", "storage", "--dir", str(tmp_path / "d"), "--listen", "tcp://127.0.0.1:0",
           "--capacity", "1MiB", "--name", "cli-node"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("deepinfer storage: cli-node listening on tcp://127.0.0.1:"), line
        address = line.split()[5]

        async def put_one():
            async with RequestClient(address, StorageReply) as client:
                frag = ErasureCodec().encode(b"persist", os.urandom(5000))[0]
                return await client.request(PutFragments("chat", [_meta(frag)]), buffers=[frag.payload], timeout_s=10)

        assert asyncio.run(put_one()).statuses == [FragmentStatus.OK]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    # the index survived the graceful stop: a new process reports the fragment at once
    again = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert "(1 fragments," in again.stdout.readline()
    finally:
        again.terminate()
        assert again.wait(timeout=30) == 0
        again.stdout.close()


def test_storage_command_bad_input_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer.bin", "storage", "--dir", str(tmp_path), "--capacity", "huge"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.strip() == "deepinfer storage: --capacity 'huge' is not a size like 500GiB, 20TB or 1048576"
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer.bin", "storage", "--dir", str(tmp_path), "--ttl", "agent"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr and "CLASS=DURATION" in out.stderr
