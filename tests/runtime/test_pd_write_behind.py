"""A serial engine loop (a prefill engine's) writes a finished request's blocks behind at once,
not at its next step: the next turn of the conversation may be routed to another engine, which
finds them only in the store. Before, the copy-out waited for the next plan of the same engine."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.runtime.disagg.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(120)


async def test_a_serial_loop_writes_blocks_behind_without_another_step(tmp_path):
    write_tiny_model(tmp_path / "m", seed=3, layers="WC")
    parts = build_engine(tmp_path / "m", EngineOptions(dtype="float32", block_size=16, num_blocks=64, max_model_len=512,
                                                     num_threads=1, kv_store_dir=str(tmp_path / "kv")))
    loop = EngineLoop(parts.core, name="prefill-test", is_pipelined=False)
    loop.start()
    try:
        done = asyncio.get_running_loop().create_future()
        parts.core.add_request("r", list(range(10, 60)), SamplingParams(max_tokens=1, temperature=0.0))
        loop.add_sink("r", lambda out: done.set_result(out) if getattr(out, "finished", True) and not done.done() else None)
        await asyncio.wait_for(done, 60)
        offload = parts.kv_offload
        for _ in range(100):  # the write runs on the device and writer threads; no step follows
            if offload.stats.num_written_store >= 3:
                break
            await asyncio.sleep(0.05)
        assert offload.stats.num_copied_out == 3 and offload.stats.num_written_store == 3  # 50 tokens: 3 full blocks
        assert loop.num_steps == 1
    finally:
        await loop.stop()
        parts.kv_offload.close()
