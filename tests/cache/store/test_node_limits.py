"""A storage node's defences: bounded receive buffers, and admin messages only from trusted peers."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer.cache.store.admin_policy import AdminPolicy, parse_networks
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.cache.store.node import StorageNode, StorageNodeConfig
from deepinfer.transport import security
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import DeadlineExceeded, RemoteError
from deepinfer.transport.protocol import (
    ErrorCode,
    FragmentMeta,
    GcDone,
    PutFragments,
    RunGc,
    StorageReply,
    StorageStats,
    StorageStatsRequest,
)

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


def _memory_mib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def _via(source_ip: str, address: str) -> str:
    """``address`` dialled from ``source_ip`` (libzmq's tcp://SOURCE:0;HOST:PORT form)."""
    return address.replace("tcp://", f"tcp://{source_ip}:0;", 1)


async def test_a_300_mib_attachment_neither_balloons_nor_stays_in_the_daemon(tmp_path):
    with LocalCluster(tmp_path, 1) as cluster:
        pid, address = cluster.pid("node-00"), cluster.addresses["node-00"]
        async with RequestClient(address, StorageReply) as client:
            assert isinstance(await client.request(StorageStatsRequest(), timeout_s=10), StorageStats)
            before = _memory_mib(pid)
            huge = bytes(300 * MiB)
            meta = FragmentMeta(b"too-big", 0, 10, 2, 3000 * MiB, 0, 1)
            t0 = time.monotonic()
            with pytest.raises((RemoteError, DeadlineExceeded)):  # refused (OVERSIZED) or cut off by libzmq
                await client.request(PutFragments("chat", [meta]), buffers=[huge], timeout_s=3)
            del huge
            assert time.monotonic() - t0 < 4
            # the daemon still serves (the client reconnects if libzmq cut the connection)
            for _ in range(50):
                try:
                    assert isinstance(await client.request(StorageStatsRequest(), timeout_s=1), StorageStats)
                    break
                except DeadlineExceeded:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("the daemon stopped answering after an oversized attachment")
            await asyncio.sleep(0.3)
            after = _memory_mib(pid)
    assert after["VmHWM"] - before["VmHWM"] < 64, f"daemon peaked {after['VmHWM'] - before['VmHWM']} MiB higher"
    assert after["VmRSS"] - before["VmRSS"] < 64, f"daemon kept {after['VmRSS'] - before['VmRSS']} MiB"


async def test_run_gc_only_from_loopback_unless_allowed(tmp_path):
    with LocalCluster(tmp_path, 1) as cluster:
        address = cluster.addresses["node-00"]
        async with RequestClient(_via("127.0.0.2", address), StorageReply) as remote, \
                RequestClient(_via("127.0.0.1", address), StorageReply) as local:  # fmt: skip
            with pytest.raises(RemoteError) as refused:
                await remote.request(RunGc(), timeout_s=10)
            assert refused.value.code == ErrorCode.FORBIDDEN and "127.0.0.2" in str(refused.value)
            assert isinstance(await remote.request(StorageStatsRequest(), timeout_s=10), StorageStats)  # not admin
            assert isinstance(await local.request(RunGc(), timeout_s=10), GcDone)
        cluster.kill("node-00")
        cluster.restart("node-00", ["--admin-from", "127.0.0.0/8"])
        async with RequestClient(_via("127.0.0.2", address), StorageReply) as remote:
            assert isinstance(await remote.request(RunGc(), timeout_s=10), GcDone)


async def test_with_curve_only_listed_keys_administer(tmp_path):
    server, admin, other = (security.generate_keypair() for _ in range(3))
    for client_keys, allowed_admin in (((admin.public,), True), ((), False)):
        config = StorageNodeConfig(
            dir=tmp_path / f"n{len(client_keys)}", listen="tcp://127.0.0.1:0", capacity_bytes=MiB,
            curve=security.CurveServerKeys(server), curve_client_keys=client_keys,
            admin=AdminPolicy(is_curve=True, admin_keys=frozenset(client_keys)),
        )  # fmt: skip
        node = StorageNode(config)
        address = await node.start()
        try:
            async with RequestClient(address, StorageReply, curve=security.CurveClientKeys(admin, server.public)) as c:
                assert isinstance(await c.request(StorageStatsRequest(), timeout_s=10), StorageStats)
                if allowed_admin:
                    assert isinstance(await c.request(RunGc(), timeout_s=10), GcDone)
                else:  # admitted (any CURVE client may read and write) but nobody's admin
                    with pytest.raises(RemoteError) as refused:
                        await c.request(RunGc(), timeout_s=10)
                    assert refused.value.code == ErrorCode.FORBIDDEN
            if allowed_admin:  # a key the node does not list is never admitted at all
                async with RequestClient(address, StorageReply, curve=security.CurveClientKeys(other, server.public)) as c:
                    with pytest.raises(DeadlineExceeded):
                        await c.request(StorageStatsRequest(), timeout_s=0.5)
        finally:
            await node.stop(drain_s=0)


def test_admin_policy():
    plain = AdminPolicy()
    assert plain.refusal("127.0.0.1", None) == "" and plain.refusal("::1", None) == ""
    assert plain.refusal(None, None) == ""  # ipc: local by construction
    assert "10.1.2.3" in plain.refusal("10.1.2.3", None)
    assert "127.0.0.2" in plain.refusal("127.0.0.2", None)
    lan = AdminPolicy(networks=parse_networks("10.0.0.0/8, 192.168.1.7"))
    assert lan.refusal("10.1.2.3", None) == "" and lan.refusal("192.168.1.7", None) == ""
    assert lan.refusal("192.168.1.8", None) != ""
    assert AdminPolicy(networks=("any",)).refusal("8.8.8.8", None) == ""
    key = b"k" * 40
    curve = AdminPolicy(is_curve=True, admin_keys=frozenset({key}))
    assert curve.refusal("127.0.0.1", None) != ""  # CURVE on: loopback is not enough
    assert curve.refusal("10.0.0.1", key.decode()) == ""
    assert curve.refusal("10.0.0.1", "x" * 40) != ""
    with pytest.raises(ValueError, match="not a CIDR"):
        parse_networks("10.0.0.0/99")
