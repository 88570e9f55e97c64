"""EngineCore on the real tiny DeepSeek-V4 runner: batching, preemption, prefix hits with SWA
replay and the pipelined loop must not change any request's tokens."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

runner_mod = pytest.importorskip("deepinfer.engine.core.model_runner")
testing = pytest.importorskip("deepinfer.engine.models.deepseek_v4.testing")

from deepinfer.engine.api.sampling_params import SamplingParams  # noqa: E402
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig  # noqa: E402
from deepinfer.engine.sched.scheduler import SchedulerConfig  # noqa: E402
from deepinfer.engine.text.output_processor import merge_output  # noqa: E402
from tests.conftest import load_test_helper  # noqa: E402

sync_steps = load_test_helper("bench/sync_steps")

BS = 16


@pytest.fixture(scope="module")
def ref():
    return testing.hf_reference(seed=3, layer_types=[testing.SLIDING, testing.CSA, testing.HCA, testing.CSA], hc_mult=2)


def make_core(ref, *, num_blocks, budget, prefix_caching=True) -> EngineCore:
    cfg = ref.config
    runner = runner_mod.ModelRunner(cfg, ref.state_dict, num_blocks=num_blocks, num_slots=8, block_size=BS)
    sched = SchedulerConfig(block_size=BS, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=4096,
                            enable_prefix_caching=prefix_caching, model_id="tiny-v4",
                            max_replay_tokens=cfg.sliding_window * cfg.num_hidden_layers)
    return EngineCore(runner, EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size),
                      seed_rng=random.Random(0))


def run(core, reqs, step, has_work):
    acc = {}
    for rid, prompt, params in reqs:
        core.add_request(rid, prompt, params)
    for _ in range(2000):
        if not has_work():
            break
        for out in step():
            acc[out.request_id] = merge_output(acc.get(out.request_id), out)
        core.check_integrity()
    return acc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_runner_concurrent_equals_alone(ref):
    vocab = ref.config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(64)]
    reqs = []
    for i in range(5):
        prompt = (prefix[: rng.choice([32, 48, 64])] if i % 2 == 0 else []) + [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]
        params = (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) if i % 2
                  else SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True))
        reqs.append((f"r{i}", prompt, params))

    alone_core = make_core(ref, num_blocks=64, budget=4096, prefix_caching=False)
    alone = {}
    for r in reqs:
        alone.update(run(alone_core, [r], (lambda: sync_steps.step(alone_core)), alone_core.has_unfinished_requests))

    core = make_core(ref, num_blocks=8, budget=64)  # small pool and budget: preemption + chunking
    together = run(core, reqs, (lambda: sync_steps.step(core)), core.has_unfinished_requests)
    assert core.scheduler.num_preemptions > 0 and core.scheduler.pool.num_hits > 0
    assert any(out.num_cached_tokens > 0 for out in together.values())

    core2 = make_core(ref, num_blocks=8, budget=64)
    with ThreadPoolExecutor(1) as ex:
        pipe = sync_steps.StepPipeline(core2, ex)
        piped = run(core2, reqs, pipe.step, pipe.has_work)
    for rid in alone:
        want = alone[rid].outputs[0].token_ids
        assert len(want) == 6
        assert together[rid].outputs[0].token_ids == want, rid
        assert piped[rid].outputs[0].token_ids == want, rid


@pytest.mark.timeout(300)
def test_real_runner_device_fed_decode_equals_sync(ref):
    """The pipelined loop with device-fed ids (the chain launches each decode forward on the
    previous step's sampled tensor, ForwardBatch.token_source) gives the synchronous tokens on
    the real model; forced on here, where the CPU is the device."""
    vocab = ref.config.vocab_size
    rng = random.Random(1)
    reqs = [(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(3, 40))],
             SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True))
            for i in range(4)]  # fmt: skip
    sync_core = make_core(ref, num_blocks=32, budget=256)
    want = run(sync_core, reqs, (lambda: sync_steps.step(sync_core)), sync_core.has_unfinished_requests)
    core = make_core(ref, num_blocks=32, budget=256)
    with ThreadPoolExecutor(1) as ex:
        pipe = sync_steps.StepPipeline(core, ex, feed_ids=True)
        got = run(core, reqs, pipe.step, pipe.has_work)
        num_fed = pipe._pipe._chain.num_fed
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in want.items()}
    assert num_fed >= 5, num_fed
