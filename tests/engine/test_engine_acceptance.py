"""Issue 4 acceptance through AsyncEngine on a real tiny DeepSeek-V4 checkpoint directory.

64 requests (greedy and seeded temperature 0.8, a third sharing prefixes) arrive at random times
while others run, in an engine whose block pool is far too small for them (preemption) and
whose token budget chunks prefills; every request must produce exactly the tokens it produces
alone, check_integrity() runs after every step, and aborting requests mid-flight gives every
block and slot back.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from deepinfer import AsyncEngine, SamplingParams
from deepinfer.engine.loader.checkpoint_writer import save_checkpoint
from deepinfer.engine.text.output_processor import merge_output

testing = pytest.importorskip("deepinfer.engine.models.deepseek_v4.testing")

BS = 16
NUM_REQUESTS = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    ref = testing.hf_reference(seed=3, layer_types=[testing.SLIDING, testing.CSA, testing.HCA, testing.CSA], hc_mult=2)
    path = tmp_path_factory.mktemp("tiny_v4_acceptance")
    save_checkpoint(path, ref.config, ref.state_dict)
    return path


def make_requests(vocab: int) -> list[tuple[str, list[int], SamplingParams, float]]:
    rng = random.Random(4)
    prefixes = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(3)]
    reqs = []
    for i in range(NUM_REQUESTS):
        head = rng.choice(prefixes)[: rng.choice([16, 32, 48])] if i % 3 == 0 else []
        prompt = head + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))]
        max_tokens = rng.randint(3, 14)
        if i % 2:
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        reqs.append((f"r{i}", prompt, params, rng.uniform(0.0, 0.4)))  # many at once: the pool runs out
    return reqs


async def run_one(engine, rid, prompt, params, delay=0.0):
    await asyncio.sleep(delay)
    acc = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        acc = merge_output(acc, out)
    return acc


@pytest.mark.timeout(240)
async def test_64_requests_with_random_arrival_equal_each_alone_under_preemption(model_dir):
    common = dict(dtype="float32", device="cpu", block_size=BS, skip_tokenizer_init=True)
    alone_engine = await AsyncEngine.start(model=str(model_dir), max_num_seqs=1, num_blocks=64,
                                           enable_prefix_caching=False, **common)
    try:
        reqs = make_requests(alone_engine.model_info.vocab_size)
        alone = {}
        for rid, prompt, params, _ in reqs:
            alone[rid] = (await run_one(alone_engine, rid, prompt, params)).outputs[0]
    finally:
        await alone_engine.shutdown()
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in alone.values())

    # 8 sequences of up to 7 blocks each share 20 blocks: preemption; a 48-token budget chunks prefills
    engine = await AsyncEngine.start(model=str(model_dir), max_num_seqs=8, num_blocks=20, max_num_batched_tokens=48,
                                     check_integrity_every_step=True, **common)
    try:
        results = await asyncio.gather(*(run_one(engine, rid, p, sp, delay) for rid, p, sp, delay in reqs))
        sched = engine.core.scheduler
        assert sched.num_preemptions > 0, "the pool was meant to force preemption"
        assert sched.pool.num_hits > 0 and any(r.num_cached_tokens > 0 for r in results)
        mismatched = [r.request_id for r in results if r.outputs[0].token_ids != alone[r.request_id].token_ids]
        assert not mismatched, mismatched
        assert [r.outputs[0].finish_reason for r in results] == [alone[r.request_id].finish_reason for r in results]

        # aborts mid-flight free everything
        long = SamplingParams(temperature=0.8, seed=5, max_tokens=200, ignore_eos=True)
        streams = [await engine.submit({"prompt_token_ids": reqs[i][1]}, long, request_id=f"x{i}") for i in range(12)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams[:4]))
        assert all(not f.finished for f in firsts)
        assert sched.num_unfinished == 12
        for i in range(0, 12, 2):
            await engine.abort(f"x{i}")
        for s in streams[1::2]:
            s.close()
        ends = [o async for o in streams[0]]
        assert ends[-1].outputs[0].finish_reason == "abort"
        for _ in range(10):
            await asyncio.sleep(0.02)  # let the step in flight commit (its results are dropped)
        assert not sched.requests and sched.num_unfinished == 0
        assert sched.pool.num_free_blocks == sched.pool.num_blocks and sched.slots.num_free_slots == 8
        engine.core.check_integrity()
        assert engine.stats().kv_cache_usage == 0.0
    finally:
        await engine.shutdown()
