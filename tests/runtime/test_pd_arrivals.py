"""A decode engine names each arrived KV transfer by (prefill instance, handoff id).

Every prefill counts handoffs from 1, so with two prefills the counter alone collides: the decode
once imported prefill-1's request as the answer to prefill-0's ready (the gateway then waited on
prefill-0's request until its deadline with no error anywhere). Real data plane, real decode
service on a tiny core; no node or cluster around it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import numpy as np
import pytest

from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.runtime.disagg.decode import DecodeService
from deepinfer.runtime.disagg.engine_service import EngineServiceConfig
from deepinfer.transport.codec import Codec
from deepinfer.transport.dataplane import BulkReceiver, BulkSender
from deepinfer.transport.protocol import EngineRef, PdKvPush

DECODE_INSTANCE = 0xD0


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pd-arrivals")
    write_tiny_model(path, seed=5, layers="WCHC")
    return build_engine(path, EngineOptions(dtype="float32", device="cpu", block_size=128, max_model_len=512,
                                            num_blocks=8, max_num_seqs=2))


def _push(prefill_instance: int, handoff_id: int, request_id: str) -> bytes:
    return Codec(PdKvPush).encode(PdKvPush(
        handoff_id=handoff_id, request_id=request_id, attempt=0,
        prefill=EngineRef(f"prefill-{prefill_instance}", prefill_instance, "ipc://unused"),
        decode_instance_id=DECODE_INSTANCE, prompt_token_ids=[5, 6, 7], output_token_ids=[8], sampling=b"",
        seed=1, num_computed_tokens=3, block_size=128, num_blocks=1, buffer_names=["b.x"], gateway_name="gw",
        gateway_instance_id=1, stream_address="ipc://unused", lease_s=5.0))


@pytest.mark.timeout(60)
async def test_same_handoff_id_from_two_prefills_stays_two_arrivals(parts):
    root = tempfile.mkdtemp(prefix="di-arr-")
    address = f"ipc://{root}/decode.data"
    service = DecodeService(parts, EngineServiceConfig(engine_address="ipc://unused", data_address=address))
    service.instance_id = DECODE_INSTANCE
    service.node_name = "decode-0"
    service.receiver = BulkReceiver(address, name="decode-0-kv")
    senders = [BulkSender(address, name=f"prefill-{i}-kv") for i in (1, 2)]
    receiving = None
    try:
        await service.receiver.start()
        receiving = asyncio.create_task(service._receive())
        for sender in senders:
            await sender.start()
        # both prefills' first handoff (id 1) lands before either ready is served
        await asyncio.gather(
            senders[0].send([np.full(64, 1, np.uint8)], meta=_push(1, 1, "req-a"), timeout_s=20),
            senders[1].send([np.full(64, 2, np.uint8)], meta=_push(2, 1, "req-b"), timeout_s=20))
        for _ in range(200):
            if service._num_held()[2] == 2:
                break
            await asyncio.sleep(0.01)
        assert service._num_held()[2] == 2  # neither transfer overwrote the other
        got_b = await asyncio.wait_for(service._wait_arrival((2, 1)), 10)
        got_a = await asyncio.wait_for(service._wait_arrival((1, 1)), 10)
        assert got_a is not None and got_b is not None
        assert (got_a.push.request_id, got_b.push.request_id) == ("req-a", "req-b")
        assert int(got_a.transfer.view(0)[0]) == 1 and int(got_b.transfer.view(0)[0]) == 2
        got_a.transfer.release()
        got_b.transfer.release()
        assert service._num_held()[2] == 0
    finally:
        if receiving is not None:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
        for sender in senders:
            await sender.close()
        await service.receiver.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(60)
async def test_concurrent_first_pushes_share_one_side_link():
    """A burst of handoffs on a fresh link (a prefill's first requests) opens one same-host side
    channel: several used to be opened at once, the earlier ones' ack readers were orphaned
    (garbage-collected while pending) and their end failed or stalled the other transfers."""
    root = tempfile.mkdtemp(prefix="di-arr-")
    address = f"ipc://{root}/decode.data"
    receiver = BulkReceiver(address, name="decode-0-kv")
    sender = BulkSender(address, name="prefill-0-kv")
    try:
        await receiver.start()
        await sender.start()
        results = await asyncio.gather(*(sender.send([np.full(4096, i, np.uint8)], meta=b"m%d" % i, timeout_s=20)
                                         for i in range(8)))
        assert len(receiver._side_writers) == 1  # one link carried all eight
        got = {}
        for _ in results:
            transfer = await asyncio.wait_for(receiver.recv(), 10)
            got[transfer.meta] = int(transfer.view(0)[0])
            transfer.release()
        assert got == {b"m%d" % i: i for i in range(8)}
    finally:
        await sender.close()
        await receiver.close()
        shutil.rmtree(root, ignore_errors=True)
