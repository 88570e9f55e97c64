"""A slot-owner engine process for tests/engine/test_swa_cross_process.py (run as a script).

Builds the tiny reference engine with SWA slots, publishes its slot events and serves fetches;
prints one JSON line with its addresses, then answers JSON commands on stdin, one per line:
``{"prompt": [...], "max_tokens": n}`` -> ``{"tokens": [...], "num_restored": k, "num_saved": s}``.
"""

from __future__ import annotations

import asyncio
import json
import random
import runpy
import sys
from pathlib import Path

from deepinfer.cache.swa_fetch import SwaSlotOwner
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.hooks import EngineHooks
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.kv.swa_slots import build_swa_slots
from deepinfer.engine.models.deepseek_v4 import testing
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.transport.channels import EventPublisher

sync_steps = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "sync_steps.py"))

BS = 16


def build_core(ref, swa=None) -> EngineCore:
    """``swa``: build_swa_slots options; the core is built with those SWA slots (core.hooks.swa_slots)."""
    cfg = ref.config
    runner = ModelRunner(cfg, ref.state_dict, num_blocks=64, num_slots=4, block_size=BS)
    sched = SchedulerConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=4096,
                            model_id="tiny-v4")
    hooks = EngineHooks()
    if swa is not None:
        parts = build_swa_slots(runner, sched, **swa)
        runner, sched, hooks = parts.runner, parts.scheduler, EngineHooks(swa_slots=parts.manager)
    return EngineCore(runner, EngineCoreConfig(sched, num_blocks=64, vocab_size=cfg.vocab_size), seed_rng=random.Random(0),
                      hooks=hooks)


def build_reference():
    return testing.hf_reference(seed=3, layer_types=[testing.SLIDING, testing.CSA, testing.HCA, testing.CSA], hc_mult=2)


def generate(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    acc = None
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        for out in sync_steps["step"](core):
            acc = merge_output(acc, out)
    return list(acc.outputs[0].token_ids)


async def main() -> None:
    core = build_core(build_reference(), swa=dict(mode="bounded", num_store_slots=8))
    mgr = core.hooks.swa_slots
    pub = EventPublisher("tcp://127.0.0.1:*")
    await pub.start()
    owner = SwaSlotOwner(mgr.store, node_name="owner", instance_id=random.getrandbits(48),
                         fetch_address="tcp://127.0.0.1:*", publisher=pub, publish_interval_s=0.02,
                         resync_interval_s=0.2)
    await owner.start()
    print(json.dumps({"events": pub.address, "fetch": owner.fetch_address}), flush=True)
    loop = asyncio.get_running_loop()
    n = 0
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        n += 1
        toks = generate(core, f"r{n}", cmd["prompt"], cmd["max_tokens"])
        await owner.publish_now()
        print(json.dumps({"tokens": toks, "num_restored": mgr.stats.num_restored, "num_saved": mgr.stats.num_saved}),
              flush=True)
    await owner.close()
    await pub.close()


if __name__ == "__main__":
    asyncio.run(main())
