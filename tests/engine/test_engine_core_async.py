"""The asyncio step pipeline: same outputs as synchronous steps; the loop stays responsive."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.step_loop import AsyncStepPipeline
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

sync_steps = load_test_helper("bench/sync_steps")

VOCAB = 32


class SlowHashRunner:
    """Logits from (position, last token); each forward sleeps ``delay`` (GIL released)."""

    def __init__(self, delay: float):
        self.delay = delay

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        time.sleep(self.delay)
        rows = []
        for st in batch.steps:
            for i in range(st.num_tokens - st.num_logits, st.num_tokens):
                g = torch.Generator().manual_seed(st.start_pos + i + 1000 * st.token_ids[i])
                rows.append(torch.randn(VOCAB, generator=g))
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


def make(delay: float) -> EngineCore:
    cfg = EngineCoreConfig(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16),
                           num_blocks=128, vocab_size=VOCAB)
    return EngineCore(SlowHashRunner(delay), cfg, seed_rng=random.Random(0))


REQS = [(f"r{i}", [1 + i, 2, 3 + i % 5] * (1 + i % 4), SamplingParams(temperature=0.8, seed=i, max_tokens=6))
        for i in range(6)]


def sync_outputs():
    core = make(0.0)
    for r in REQS:
        core.add_request(*r)
    acc = {}
    while core.has_unfinished_requests():
        for o in sync_steps.step(core):
            acc[o.request_id] = merge_output(acc.get(o.request_id), o)
    return {k: v.outputs[0].token_ids for k, v in acc.items()}


async def test_async_pipeline_matches_sync_and_keeps_loop_responsive():
    core = make(0.2)
    for r in REQS:
        core.add_request(*r)
    lags: list[float] = []
    stop = False

    async def ping():
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    pinger = asyncio.create_task(ping())
    acc = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = AsyncStepPipeline(core, ex)
        t0 = time.perf_counter()
        while pipe.has_work():
            for o in await pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
            core.check_integrity()
            if time.perf_counter() - t0 > 1.0:
                break  # a few 200 ms steps are enough to watch the loop
        core.abort([rid for rid, _, _ in REQS])
        await pipe.drain()
    stop = True
    await pinger
    assert len(lags) > 20  # the loop ran pings all through the 200 ms forwards
    assert sorted(lags)[len(lags) // 2] < 0.010

    core = make(0.0)
    for r in REQS:
        core.add_request(*r)
    acc = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = AsyncStepPipeline(core, ex)
        while pipe.has_work():
            for o in await pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
    assert {k: v.outputs[0].token_ids for k, v in acc.items()} == sync_outputs()
    assert not core.scheduler.requests and core.scheduler.slots.num_free_slots == 8
