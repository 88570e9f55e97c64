"""KV tiers under AsyncEngine: two AsyncEngine instances on one event loop share an fs store; the
first writes its prompt's blocks behind once idle (no further request needed), the second loads
them and streams the same greedy tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE
from deepinfer.cache.store.fs_backend import FsStore
from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.core.factory import EngineParts
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from tests.conftest import load_test_helper

pytestmark = pytest.mark.timeout(300)


h = load_test_helper("engine/kv_tiers_harness")
NUM_BLOCKS = 16


def _engine(store_dir: Path) -> tuple[AsyncEngine, KVOffload]:
    runner = h.make_runner(NUM_BLOCKS)
    offload = KVOffload.build(runner, host_capacity_bytes=1 << 20, store=FsStore(store_dir),
                              config=KVOffloadConfig(load_deadline_s=5.0))
    core = h.make_core(runner, NUM_BLOCKS, offload)
    parts = EngineParts(core, runner.config, None, None, 4096, "tiny-v4-kv-tiers", int(time.time()))
    return AsyncEngine(parts, EngineOptions(block_size=h.BLOCK_SIZE, max_num_seqs=runner.num_slots)), offload


async def _run(engine: AsyncEngine, ids: list[int]):
    last = None
    tokens: list[int] = []
    async for out in engine.generate({"prompt_token_ids": ids}, h.greedy(6)):
        tokens += out.outputs[0].token_ids
        last = out
    return tokens, last


async def test_two_async_engines_share_an_fs_store(tmp_path):
    ids = h.prompt(31, 700)  # (700 - 1) // 128 = 5 blocks can hit
    first, off1 = _engine(tmp_path / "kv")
    try:
        want, out1 = await _run(first, ids)
        assert out1.num_cached_tokens == 0
        # the engine is idle now: its last copy-outs were queued on the device thread by the
        # pipeline itself; wait for them to reach the store
        for _ in range(200):
            if off1.stats.num_copied_out >= 5:
                break
            await asyncio.sleep(0.01)
        assert off1.wait_for_writes(30) and off1.stats.num_written_store >= 5
    finally:
        await first.shutdown()
        off1.close()

    second, off2 = _engine(tmp_path / "kv")
    try:
        got, out2 = await _run(second, ids)
        assert got == want and len(got) == 6
        assert out2.num_cached_tokens == 5 * h.BLOCK_SIZE
        assert out2.metrics.cached_tokens_by_tier == {TIER_DEVICE: 0, TIER_HOST: 0, TIER_STORE: 5 * h.BLOCK_SIZE}
    finally:
        await second.shutdown()
        off2.close()

