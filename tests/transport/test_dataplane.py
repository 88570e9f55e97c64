"""Bulk data plane over real sockets: byte-identical transfers, limits, bad senders, fallbacks."""

import asyncio
import ctypes
import hashlib
import os
import shutil
import struct
import sys
import tempfile

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.transport import cma
from deepinfer.transport.buffers import BufferPool
from deepinfer.transport.codec import Codec
from deepinfer.transport.dataplane import BulkReceiver, BulkSender, plan_segments
from deepinfer.transport.errors import DeadlineExceeded, OversizedFrame
from deepinfer.transport.protocol import BufferSpec, BulkAck, BulkBegin, BulkChunk, BulkFrame, CmaSource, ErrorCode

MiB = 1 << 20


@pytest.fixture
def ipc_dir():
    path = tempfile.mkdtemp(prefix="di-", dir="/tmp")  # ipc paths must stay short (<108 bytes)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def address_for(kind: str, ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/bulk.ipc" if kind.startswith("ipc") else "tcp://127.0.0.1:0"


@given(sizes=st.lists(st.integers(0, 5000), max_size=6), chunk=st.integers(1, 3000))
def test_plan_covers_every_byte_once_within_chunk_limit(sizes, chunk):
    plan = plan_segments(sizes, chunk)
    assert len(plan) >= 1
    covered = {i: [] for i in range(len(sizes))}
    for message in plan:
        assert sum(s.length for s in message) <= chunk
        for s in message:
            assert s.length > 0
            covered[s.index].append((s.offset, s.length))
    for i, size in enumerate(sizes):
        pos = 0
        for offset, length in covered[i]:  # in order, no gaps, no overlap
            assert offset == pos
            pos += length
        assert pos == size
    assert len(plan) == max(1, -(-sum(sizes) // chunk))  # messages are packed full


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["ipc", "ipc-frames", "tcp"])
async def test_64mib_transfer_is_byte_identical(kind, ipc_dir):
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, 64 * MiB, dtype=np.uint8)
    floats = rng.standard_normal((3, 1000)).astype(np.float32)
    bf16 = torch.randn(17, 33).to(torch.bfloat16)
    pool = BufferPool()
    async with BulkReceiver(address_for(kind, ipc_dir), pool=pool) as receiver:
        use_cma = None if kind == "ipc" else False
        async with BulkSender(receiver.address, use_cma=use_cma) as sender:
            assert sender.is_cma == (kind == "ipc" and cma.is_supported())
            result = await sender.send([big, floats, b"", bf16, b"tail"], meta=b"kv:42", timeout_s=60)
            transfer = await asyncio.wait_for(receiver.recv(), 10)
    expected_bytes = big.nbytes + floats.nbytes + bf16.numel() * 2 + 4
    assert result.num_bytes == transfer.num_bytes == expected_bytes
    assert transfer.meta == b"kv:42" and transfer.transfer_id == result.transfer_id
    assert np.array_equal(transfer.view(0), big)
    assert np.array_equal(transfer.view(1), floats) and transfer.view(1).dtype == np.float32
    assert transfer.view(2).size == 0
    received_bf16 = transfer.view(3)
    assert received_bf16.dtype == torch.bfloat16 and torch.equal(received_bf16, bf16)
    assert bytes(transfer.view(4)) == b"tail"
    transfer.release()
    assert pool.num_kept_bytes > 64 * MiB  # buffers went back to the pool


async def test_pool_buffers_are_reused_across_transfers(ipc_dir):
    pool = BufferPool()
    payload = np.arange(3 * MiB, dtype=np.uint8)
    async with BulkReceiver("tcp://127.0.0.1:0", pool=pool) as receiver:
        async with BulkSender(receiver.address, chunk_bytes=MiB) as sender:
            for _ in range(3):
                await sender.send([payload])
                transfer = await receiver.recv()
                assert np.array_equal(transfer.view(0), payload)
                transfer.release()
    assert pool.num_allocations == 1


async def test_concurrent_senders_interleave_without_mixing_data():
    async with BulkReceiver("tcp://127.0.0.1:0") as receiver:
        senders = [await BulkSender(receiver.address, chunk_bytes=64 * 1024).start() for _ in range(3)]
        try:
            payloads = [np.full(1 * MiB + i, i + 1, dtype=np.uint8) for i in range(6)]
            await asyncio.gather(*(senders[i % 3].send([p], meta=bytes([i])) for i, p in enumerate(payloads)))
            got = [await asyncio.wait_for(receiver.recv(), 5) for _ in payloads]
        finally:
            for sender in senders:
                await sender.close()
    for transfer in got:
        i = transfer.meta[0]
        assert np.array_equal(transfer.view(0), payloads[i])


async def test_oversized_transfer_is_refused_and_receiver_keeps_serving():
    pool = BufferPool()
    async with BulkReceiver("tcp://127.0.0.1:0", pool=pool, max_bulk_bytes=MiB) as receiver:
        async with BulkSender(receiver.address, chunk_bytes=256 * 1024) as sender:
            with pytest.raises(OversizedFrame) as info:
                await sender.send([np.zeros(2 * MiB, np.uint8)], timeout_s=10)
            assert info.value.code == ErrorCode.OVERSIZED
            await sender.send([b"small"], timeout_s=10)
            assert bytes((await receiver.recv()).view(0)) == b"small"
        assert receiver.num_in_progress == 0
        assert pool.num_allocations == 1  # nothing was allocated for the refused transfer


@pytest.fixture
async def receiver_and_raw():
    ctx = zmq.asyncio.Context()
    pool = BufferPool()
    receiver = BulkReceiver("tcp://127.0.0.1:0", ctx=ctx, pool=pool, idle_timeout_s=0.3)
    await receiver.start()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(receiver.address)
    try:
        yield receiver, raw, pool
    finally:
        raw.close(0)
        await receiver.close()
        ctx.term()


async def next_ack(raw) -> BulkAck:
    return Codec(BulkAck).decode(await asyncio.wait_for(raw.recv(), 5))


async def test_bad_bulk_messages_get_typed_acks_and_free_their_buffers(receiver_and_raw):
    receiver, raw, pool = receiver_and_raw
    frames = Codec(BulkFrame)
    spec = [BufferSpec(num_bytes=100)]
    await raw.send_multipart([b"\xc1 garbage"])  # undecodable header: dropped, nobody to ack
    await raw.send_multipart([frames.encode(BulkBegin(1, spec, 64)), b"x" * 64, b"y" * 10])  # short segment
    assert (await next_ack(raw)).code == ErrorCode.MALFORMED
    await raw.send_multipart([frames.encode(BulkBegin(2, spec, 64)), b"x" * 64, b"x" * 64])  # too many
    assert (await next_ack(raw)).code == ErrorCode.MALFORMED
    await raw.send_multipart([frames.encode(BulkBegin(3, spec, 64)), b"x" * 64])
    await raw.send_multipart([frames.encode(BulkChunk(3, 5)), b"x" * 36])  # out of sequence
    assert (await next_ack(raw)).code == ErrorCode.TRANSFER_FAILED
    await raw.send_multipart([frames.encode(BulkChunk(99, 1)), b"x"])  # unknown transfer: quietly dropped
    await raw.send_multipart([frames.encode(BulkBegin(4, spec, 64)), b"a" * 64])
    await raw.send_multipart([frames.encode(BulkChunk(4, 1)), b"b" * 36])
    ack = await next_ack(raw)
    assert (ack.transfer_id, ack.code, ack.num_bytes) == (4, ErrorCode.OK, 100)
    transfer = await receiver.recv()
    assert bytes(transfer.view(0)) == b"a" * 64 + b"b" * 36
    assert receiver.num_in_progress == 0
    assert receiver.stats.dropped_by_code == {ErrorCode.MALFORMED: 3, ErrorCode.TRANSFER_FAILED: 1}
    transfer.release()
    assert pool.num_kept_bytes == 64 * 1024 * pool.num_allocations  # every buffer is back


async def test_sender_that_goes_quiet_mid_transfer_is_dropped_after_idle_timeout(receiver_and_raw):
    receiver, raw, pool = receiver_and_raw
    begin = BulkBegin(7, [BufferSpec(num_bytes=1000)], 100)
    await raw.send_multipart([Codec(BulkFrame).encode(begin), b"z" * 100])
    await asyncio.sleep(0.1)
    assert receiver.num_in_progress == 1
    ack = await asyncio.wait_for(next_ack(raw), 3)
    assert (ack.transfer_id, ack.code) == (7, ErrorCode.TRANSFER_FAILED)
    assert receiver.num_in_progress == 0 and pool.num_kept_bytes > 0


async def test_sender_deadline_when_nobody_acks_leaves_nothing_pending():
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.linger = 0
    silent.bind("tcp://127.0.0.1:0")
    try:
        async with BulkSender(silent.last_endpoint.decode(), ctx=ctx) as sender:
            with pytest.raises(DeadlineExceeded):
                await sender.send([np.ones(1000, np.uint8)], timeout_s=0.2)
            assert sender.num_pending == 0
            frames = await asyncio.wait_for(silent.recv_multipart(), 2)
            assert isinstance(Codec(BulkFrame).decode(frames[1]), BulkBegin)
            abort = await asyncio.wait_for(silent.recv_multipart(), 2)  # the sender said it gave up
            assert type(Codec(BulkFrame).decode(abort[1])).__name__ == "BulkAbort"
    finally:
        silent.close(0)
        ctx.term()


ATTACKER = """
import asyncio, struct, sys
import msgspec
from deepinfer.transport.protocol import BufferSpec, BulkBegin, BulkAck, CmaSource

async def main(path, address):
    reader, writer = await asyncio.open_unix_connection(path)
    # point the receiver at an address of ANOTHER process (the test process) holding a secret
    body = msgspec.msgpack.encode(BulkBegin(1, [BufferSpec(num_bytes=64)], 64, b"", CmaSource([address])))
    writer.write(struct.pack("<I", len(body)) + body)
    length = struct.unpack("<I", await reader.readexactly(4))[0]
    print(msgspec.msgpack.decode(await reader.readexactly(length), type=BulkAck).code, flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.skipif(not cma.is_supported(), reason="needs Linux process_vm_readv")
async def test_side_channel_peer_can_only_point_at_its_own_memory(ipc_dir):
    secret = np.frombuffer(bytearray(b"secret-kv-cache!" * 4), np.uint8)
    async with BulkReceiver(f"ipc://{ipc_dir}/atk.ipc") as receiver:
        assert receiver.accepts_cma
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ATTACKER, cma.side_path(receiver.address), str(secret.ctypes.data),
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        # the kernel named the attacker's pid: its own memory at that address is read (or faults),
        # never the secret that lives in ours
        delivered = []
        while not receiver._done.empty():
            delivered.append(bytes(receiver._done.get_nowait().view(0)))
        assert all(data != secret.tobytes() for data in delivered)
        code = int(out.decode().strip().rsplit(".", 1)[-1]) if out.strip() else None
        assert code in (ErrorCode.OK, ErrorCode.TRANSFER_FAILED), out
        assert receiver.num_in_progress == 0


async def test_cross_memory_header_over_zmq_is_refused(receiver_and_raw):
    receiver, raw, pool = receiver_and_raw
    begin = BulkBegin(1, [BufferSpec(num_bytes=16)], 64, source=CmaSource([12345]))
    await raw.send_multipart([Codec(BulkFrame).encode(begin)])
    assert (await next_ack(raw)).code == ErrorCode.MALFORMED
    assert receiver.num_in_progress == 0


@pytest.mark.skipif(not cma.is_supported(), reason="needs Linux process_vm_readv")
async def test_sender_uses_frames_when_the_receiver_has_no_side_channel(ipc_dir):
    async with BulkReceiver(f"ipc://{ipc_dir}/nocma.ipc", accept_cma=False) as receiver:
        async with BulkSender(receiver.address) as sender:
            payload = np.arange(3 * MiB, dtype=np.uint8)
            await sender.send([payload], timeout_s=20)
            assert np.array_equal((await receiver.recv()).view(0), payload)
            assert sender.is_cma and sender._side is None  # will try again later, sent frames now


RECEIVER_WITHOUT_PTRACE = """
import asyncio, ctypes, hashlib, sys
libc = ctypes.CDLL(None, use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
header, caps = Header(0x20080522, 0), (Caps * 2)()
assert libc.capget(ctypes.byref(header), caps) == 0
caps[0].effective &= ~(1 << 19)  # CAP_SYS_PTRACE: without it we may not read a non-dumpable process
caps[0].permitted &= ~(1 << 19)
assert libc.capset(ctypes.byref(header), caps) == 0
from deepinfer.transport.dataplane import BulkReceiver

async def main(address):
    async with BulkReceiver(address) as receiver:
        print("READY", flush=True)
        transfer = await receiver.recv()
        print(hashlib.sha256(transfer.view(0).tobytes()).hexdigest(), receiver.stats.dropped_by_code, flush=True)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not cma.is_supported() or os.geteuid() != 0, reason="needs root to drop a capability")
async def test_sender_falls_back_to_frames_when_the_kernel_refuses_the_pull(ipc_dir):
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable = 4
    address = f"ipc://{ipc_dir}/noptrace.ipc"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", RECEIVER_WITHOUT_PTRACE, address,
                                                stdout=asyncio.subprocess.PIPE)
    libc.prctl(pr_set_dumpable, 0, 0, 0, 0)  # now only CAP_SYS_PTRACE holders may read our memory
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"READY"
        payload = np.random.default_rng(3).integers(0, 256, 5 * MiB, dtype=np.uint8)
        async with BulkSender(address) as sender:
            await sender.send([payload], timeout_s=30)
            assert not sender.is_cma  # refused once (EPERM), frames from now on
        digest, drops = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split(" ", 1)
        assert digest == hashlib.sha256(payload.tobytes()).hexdigest()
        assert "UNAVAILABLE" in drops
    finally:
        libc.prctl(pr_set_dumpable, 1, 0, 0, 0)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def test_bulk_ack_frames_are_small():
    # the ack is what a sender waits on per transfer: keep it a handful of bytes
    assert len(Codec(BulkAck).encode(BulkAck(2**40, ErrorCode.OK, 2**33))) < 32
    assert struct.calcsize("<Q") == 8
