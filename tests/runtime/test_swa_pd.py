"""SWA slots in a disaggregated cluster (real ``deepinfer node`` processes on loopback): the
prefill engine saves a finished prompt's slot and lists it in the gateway's SWA directory; a
continued conversation restores it on the prefill (no replay) and streams the tokens a
co-located engine gives; when the prefill engine goes down (heartbeats) its slots leave the
directory."""

from __future__ import annotations

import asyncio
import random

import pytest

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.runtime.disagg.launch import LocalPdCluster
from deepinfer.transport.protocol import PdStatusRequest

BS = 16
ENGINE = dict(dtype="float32", block_size=BS, max_model_len=512, num_blocks=128, max_num_seqs=4, num_threads=1,
              swa_replay="bounded", swa_replay_tokens=16, swa_store_slots=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-swa-pd")
    write_tiny_model(path, seed=3, layers="WCWC")  # no HCA layer: blocks of 16
    return path


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


async def generate(client, prompt: list[int], max_tokens: int, rid: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    acc = None
    async for out in client.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        acc = merge_output(acc, out)
    assert acc is not None and acc.finished
    return list(acc.outputs[0].token_ids)


async def _until(pred, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_prefill_engine_restores_its_slot_and_peer_down_drops_it(model_dir):
    # the prompt ends 11 past boundary 64: the prefill engine (swa_snapshot_prompts) runs it as
    # [0, 64) + [64, 75) so its state at 64 becomes a slot
    p1 = tokens(0, 75)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, p1[:64], BS, root_hash(model_dir.name, ""))
    colocated = await AsyncEngine.start(model=str(model_dir), device="cpu", swa_snapshot_prompts=True, **ENGINE)
    try:
        want1 = await generate(colocated, p1, 5, "c1")
        want2 = await generate(colocated, p1 + want1 + tokens(1, 9), 5, "c2")
        assert colocated.swa_slots.stats.num_restored == 1
    finally:
        await colocated.shutdown()

    async with LocalPdCluster(model_dir, num_prefill=1, num_decode=1, engine_options=ENGINE,
                              heartbeat_interval_s=0.2, request_timeout_s=120.0) as cluster:
        directory = cluster.swa_directory.directory
        assert await generate(cluster.client, p1, 5, "t1") == want1
        await _until(lambda: directory.locate(hashes[3]) is not None)
        where = directory.locate(hashes[3])
        assert where.node_name == "prefill-0" and where.num_tokens == 64

        assert await generate(cluster.client, p1 + want1 + tokens(1, 9), 5, "t2") == want2
        status = await cluster.client.directory.engines["prefill-0"].rpc.request(PdStatusRequest(), timeout_s=5.0)
        assert status.swa["num_restored"] == 1 and status.swa["num_replayed_tokens"] == 0, status.swa
        decode = await cluster.client.directory.engines["decode-0"].rpc.request(PdStatusRequest(), timeout_s=5.0)
        assert decode.swa.get("num_saved", 0) == 0  # decode engines keep no slots

        # the prefill engine dies: heartbeats declare it down and its slots leave the directory
        await cluster.supervisor.kill("prefill-0")
        await _until(lambda: directory.locate(hashes[3]) is None)
        assert "prefill-0" not in directory.nodes()


def test_node_argv_carries_the_swa_flags_the_node_parses(tmp_path):
    from deepinfer.bin import cli, node
    from deepinfer.runtime.cluster_config import NodeRole

    cluster = LocalPdCluster(tmp_path, engine_options=dict(swa_replay="bounded", swa_replay_tokens=32,
                                                           swa_store_slots=3, swa_fetch_deadline_s=0.5))
    argv = cluster._argv(tmp_path / "cluster.toml", "prefill-0")
    assert argv[1:3] == ["-m", "deepinfer.bin"]
    args = cli.build_parser().parse_args(argv[3:])
    assert node._role_kwargs(args, NodeRole.PREFILL)["engine_options"] == dict(
        swa_replay="bounded", swa_replay_tokens=32, swa_store_slots=3, swa_fetch_deadline_s=0.5)
    with pytest.raises(ValueError, match="'swa_directory' is not supported by disaggregated engines"):
        LocalPdCluster(tmp_path, engine_options=dict(swa_directory="tcp://127.0.0.1:9"))


def test_node_argv_carries_the_weight_quantization(tmp_path):
    """``serve --disaggregated --quantization fp8``: every prefill/decode node serves FP8 weights."""
    from deepinfer.bin import cli, node
    from deepinfer.runtime.cluster_config import NodeRole

    cluster = LocalPdCluster(tmp_path, engine_options=dict(quantization="fp8", dtype="bfloat16"))
    for name, role in (("prefill-0", NodeRole.PREFILL), ("decode-0", NodeRole.DECODE)):
        args = cli.build_parser().parse_args(cluster._argv(tmp_path / "cluster.toml", name)[3:])
        assert node._role_kwargs(args, role)["engine_options"] == dict(quantization="fp8", dtype="bfloat16")
