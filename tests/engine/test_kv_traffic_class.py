"""A request's traffic class is the TTL class of the blocks it writes behind: two requests of
one engine, one "agent" and one without a class (the engine's default, "chat"), leave store
objects whose records carry exactly those classes (read back from the store's files), and the
engine reports every acknowledged block once (``drain_store_written``, the cache events' source)."""

from __future__ import annotations

import pytest

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.cache.store import fragment_file as ff
from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.api.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(120)

BLOCK = 16


async def run(engine: AsyncEngine, rid: str, prompt: list[int], traffic_class: str) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, traffic_class=traffic_class)
    async for _ in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        pass


async def test_blocks_are_written_under_their_requests_class(tmp_path):
    model = tmp_path / "tiny"
    write_tiny_model(model, seed=3, layers="WC")
    store = tmp_path / "kv"
    engine = await AsyncEngine.start(str(model), dtype="float32", block_size=BLOCK, num_blocks=64,
                                     max_model_len=512, num_threads=1, kv_store_dir=str(store))
    agent, chat = list(range(10, 10 + 4 * BLOCK + 3)), list(range(900, 900 + 2 * BLOCK + 5))
    try:
        await run(engine, "a", agent, "agent")
        await run(engine, "c", chat, "")
        offload = engine._parts.kv_offload
    finally:
        await engine.shutdown()  # runs the last copy-outs and waits for their writes
    written = offload.drain_store_written()
    tiers = offload.tiers

    def keys(prompt: list[int]) -> set[bytes]:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt, BLOCK, root_hash("tiny"))
        return {tiers.store_key(h) for h in hashes}

    key2class = {}
    for path in (store / "objects").rglob("*"):
        if path.is_file():
            record = ff.read_prefix(path)
            key2class[record.header.key] = record.traffic_class
    assert set(key2class) == keys(agent) | keys(chat)
    assert {key2class[k] for k in keys(agent)} == {"agent"} and len(keys(agent)) == 4
    assert {key2class[k] for k in keys(chat)} == {"chat"} and len(keys(chat)) == 2
    assert sorted(tiers.store_key(h) for h in written) == sorted(key2class)  # each block reported once
    assert offload.drain_store_written() == []


def test_a_bad_class_is_a_one_line_error():
    with pytest.raises(SamplingParamsError, match="traffic_class must be a class name"):
        SamplingParams(traffic_class="Bulk Data")
