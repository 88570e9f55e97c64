"""StepPipeline / DeviceChain: tokens equal synchronous steps on every sampling path, failures
reach the caller (and the step queued behind), the device thread never waits forever, and a
late hand-over restarts the chain."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.step_loop import AsyncStepPipeline
from deepinfer.engine.sched.scheduler import PLACEHOLDER_TOKEN_ID, SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

sync_steps = load_test_helper("bench/sync_steps")
StepPipeline = sync_steps.StepPipeline

VOCAB = 48


class HashRunner:
    """Logits from (position, token); optional sleep; raises on the forward ``fail_at``."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.num_forwards = 0
        self.num_fed = 0  # forwards whose ids came through a TokenSource
        self.threads: set[int] = set()

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_forwards += 1
        self.threads.add(threading.get_ident())
        if self.fail_at is not None and self.num_forwards == self.fail_at:
            raise RuntimeError("forward failed")
        if self.delay:
            time.sleep(self.delay)
        rows = []
        fed = {}  # step -> id taken from the device tensor (the ForwardBatch.token_source contract)
        if batch.token_source is not None:
            src = batch.token_source
            assert all(st.num_tokens == 1 for st in batch.steps)
            fed = {d: int(src.tokens[i]) for d, i in zip(src.dst, src.index)}
            self.num_fed += 1
        for k, st in enumerate(batch.steps):
            assert PLACEHOLDER_TOKEN_ID not in st.token_ids, "placeholder reached the runner"
            for i in range(st.num_tokens - st.num_logits, st.num_tokens):
                token = fed.get(k, st.token_ids[i])
                g = torch.Generator().manual_seed(st.start_pos + i + 1000 * token)
                rows.append(torch.randn(VOCAB, generator=g) * 3)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


def make(runner: HashRunner, max_num_seqs: int = 8) -> EngineCore:
    cfg = EngineCoreConfig(SchedulerConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=24),
                           num_blocks=256, vocab_size=VOCAB, eos_token_ids=(0,))
    return EngineCore(runner, cfg, seed_rng=random.Random(0))


# greedy, sampled, top-k/top-p, penalties, logprobs and prompt logprobs: plain and general steps mix
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=9),
    SamplingParams(temperature=0.9, seed=3, max_tokens=7),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4, max_tokens=8),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=6),
    SamplingParams(temperature=1.0, seed=5, logprobs=2, max_tokens=5),
    SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=4),
]


def requests(params_list):
    return [(f"r{i}", [2 + i, 3, 4 + i % 3] * (1 + i % 3), p) for i, p in enumerate(params_list)]


def run_sync(reqs):
    core = make(HashRunner())
    for r in reqs:
        core.add_request(*r)
    acc = {}
    while core.has_unfinished_requests():
        for o in sync_steps.step(core):
            acc[o.request_id] = merge_output(acc.get(o.request_id), o)
    return {k: (v.outputs[0].token_ids, v.outputs[0].logprobs) for k, v in acc.items()}


def run_pipelined(reqs, delay=0.0, late_every=0, feed_ids=None):
    runner = HashRunner(delay)
    core = make(runner)
    for r in reqs:
        core.add_request(*r)
    acc = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex, feed_ids=feed_ids)
        n = 0
        while pipe.has_work():
            n += 1
            if late_every and n % late_every == 0:
                time.sleep(0.01)  # the device thread finishes first: the chain ends and restarts
            for o in pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
            core.check_integrity()
        assert pipe.drain() == []
    assert not core.scheduler.requests
    return {k: (v.outputs[0].token_ids, v.outputs[0].logprobs) for k, v in acc.items()}, runner


@pytest.mark.parametrize("late_every", [0, 3])
@pytest.mark.parametrize("feed_ids", [False, True])
def test_pipelined_tokens_equal_sync_on_every_sampling_path(late_every, feed_ids):
    reqs = requests(PARAMS)
    ref = run_sync(reqs)
    got, runner = run_pipelined(reqs, delay=0.002, late_every=late_every, feed_ids=feed_ids)
    assert got == ref
    if not feed_ids:
        assert runner.num_fed == 0
    assert all(len(ref[rid][0]) == p.max_tokens or ref[rid][0][-1] == 0 for rid, _, p in reqs)
    assert len(runner.threads) == 1 and threading.get_ident() not in runner.threads


@pytest.mark.parametrize("late_every", [0, 4])
def test_device_fed_decode_steps_equal_sync(late_every):
    """Plain steps (greedy, seeded, top-k/top-p): the chain launches each decode forward on the
    previous step's sampled tokens through a TokenSource, before reading them on the host."""
    reqs = requests([SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                     SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True),
                     SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4, max_tokens=11, ignore_eos=True)] * 2)
    ref = run_sync(reqs)
    got, runner = run_pipelined(reqs, delay=0.002, late_every=late_every, feed_ids=True)
    assert got == ref
    assert runner.num_fed >= (5 if not late_every else 2), runner.num_fed


def test_plain_greedy_batch_uses_resolved_rows_and_matches_sync():
    reqs = requests([SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 6)
    core = make(HashRunner())
    for r in reqs:
        core.add_request(*r)
    used_rows = []
    fill = core.fill_placeholders

    def spy(plan, prev, rows=None):
        used_rows.append(rows is not None and rows.source is prev.plain_ids)
        fill(plan, prev, rows)

    core.fill_placeholders = spy
    acc = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex)
        while pipe.has_work():
            for o in pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
    assert {k: (v.outputs[0].token_ids, None) for k, v in acc.items()} == run_sync(reqs)
    assert sum(used_rows) >= 8, used_rows  # decode steps fill from rows resolved on the caller


def test_forward_failure_reaches_caller_and_fails_the_queued_step():
    core = make(HashRunner(delay=0.001, fail_at=4))
    for r in requests([SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3):
        core.add_request(*r)
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex)
        with pytest.raises(RuntimeError, match="forward failed"):
            for _ in range(10):
                pipe.step()
        num_forwards = core.runner.num_forwards
        ex.submit(lambda: None).result(timeout=5)  # the device thread is idle, not blocked
        assert core.runner.num_forwards == num_forwards  # the step behind the failed one never ran


def test_commit_failure_never_leaves_the_device_thread_waiting():
    core = make(HashRunner(delay=0.001))
    for r in requests([SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3):
        core.add_request(*r)
    commit = core.commit_step
    calls = []

    def failing_commit(plan, sampled):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("commit failed")
        return commit(plan, sampled)

    core.commit_step = failing_commit
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex)
        with pytest.raises(ValueError, match="commit failed"):
            for _ in range(10):
                pipe.step()
        ex.submit(lambda: None).result(timeout=5)  # the queued step ended (with the error)


async def test_async_pipeline_tokens_equal_sync():
    reqs = requests(PARAMS)
    core = make(HashRunner(delay=0.001))
    for r in reqs:
        core.add_request(*r)
    acc = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = AsyncStepPipeline(core, ex)
        while pipe.has_work():
            for o in await pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
            await asyncio.sleep(0)
        assert await pipe.drain() == []
    assert {k: (v.outputs[0].token_ids, v.outputs[0].logprobs) for k, v in acc.items()} == run_sync(reqs)


async def test_async_forward_failure_raises_in_the_loop():
    core = make(HashRunner(delay=0.001, fail_at=3))
    for r in requests([SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)] * 2):
        core.add_request(*r)
    with ThreadPoolExecutor(1) as ex:
        pipe = AsyncStepPipeline(core, ex)
        with pytest.raises(RuntimeError, match="forward failed"):
            for _ in range(10):
                await pipe.step()
        await asyncio.wrap_future(ex.submit(lambda: None))


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.num_submits = 0

    def submit(self, fn, /, *args, **kwargs):
        self.num_submits += 1
        return super().submit(fn, *args, **kwargs)


def test_chain_lingers_for_a_slightly_late_hand_over():
    """A caller a little late (well under LINGER_S) keeps one chain job running: no executor
    round trip per step. Idle gaps longer than the linger end the job; the next step starts one."""
    reqs = requests([SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4)
    ref = run_sync(reqs)
    core = make(HashRunner(delay=0.002))
    for r in reqs:
        core.add_request(*r)
    acc = {}
    with CountingExecutor() as ex:
        pipe = StepPipeline(core, ex)
        num_steps = 0
        while pipe.has_work():
            num_steps += 1
            for o in pipe.step():
                acc[o.request_id] = merge_output(acc.get(o.request_id), o)
        assert ex.num_submits < num_steps // 3, (ex.num_submits, num_steps)
        time.sleep(0.02)  # longer than the linger: the chain job has ended
        ex.submit(lambda: None).result(timeout=1)
    assert {k: (v.outputs[0].token_ids, None) for k, v in acc.items()} == ref


@pytest.mark.timeout(60)
def test_a_bug_in_the_chain_fails_the_step_instead_of_hanging(monkeypatch):
    from deepinfer.engine.core.device_chain import DeviceChain

    core = make(HashRunner(delay=0.001))
    for r in requests([SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2):
        core.add_request(*r)

    def broken(self):
        raise RuntimeError("chain bug")

    monkeypatch.setattr(DeviceChain, "_peek_take", broken)
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex)
        with pytest.raises(RuntimeError, match="chain bug"):
            for _ in range(5):
                pipe.step()
