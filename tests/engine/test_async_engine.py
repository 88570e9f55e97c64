"""AsyncEngine on a tiny real checkpoint: streaming, aborts, errors, failures, EngineClient."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from deepinfer import AsyncEngine, SamplingParams
from deepinfer.engine.api.async_engine import EngineDeadError, EngineStepError, InvalidPromptError
from deepinfer.engine.api.protocol import EngineClient, EngineOverloadedError
from deepinfer.engine.api.sampling_params import SamplingParamsError
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.sample.structured_output import StructuredOutputError
from deepinfer.engine.text.output_processor import merge_output

PROMPT = [5, 6, 7, 8, 9, 40, 41, 300, 301, 302, 17]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_async")
    write_tiny_model(path, seed=3, layers="WCHC")
    return path


@pytest.fixture
async def engine(model_dir):
    eng = await AsyncEngine.start(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512,
                                  max_num_seqs=4, block_size=128, check_integrity_every_step=True)
    try:
        yield eng
    finally:
        await eng.shutdown()


async def collect(engine, prompt, params, rid):
    acc, num_deltas = None, 0
    async for out in engine.generate(prompt, params, request_id=rid):
        acc = merge_output(acc, out)
        num_deltas += 1
    return acc, num_deltas


async def test_streams_deltas_and_concurrent_requests_match_alone(engine):
    alone, num_deltas = await collect(engine, {"prompt_token_ids": PROMPT}, GREEDY, "a")
    gen = alone.outputs[0]
    assert len(gen.token_ids) == 8 and gen.finish_reason == "length" and alone.finished
    assert num_deltas > 1  # streamed, not one final result
    assert gen.text == engine.tokenizer.decode(gen.token_ids)
    prompts = [{"prompt_token_ids": PROMPT}, "some text prompt", {"prompt_token_ids": PROMPT[:5]}, "another", "x y z"]
    results = await asyncio.gather(*(collect(engine, p, GREEDY, f"c{i}") for i, p in enumerate(prompts)))
    assert results[0][0].outputs[0].token_ids == gen.token_ids
    assert all(len(r.outputs[0].token_ids) == 8 for r, _ in results)
    assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0
    engine.core.check_integrity()


async def test_abort_mid_flight_frees_everything(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    gens = [engine.generate({"prompt_token_ids": PROMPT}, params, request_id=f"a{i}") for i in range(3)]
    firsts = [await g.__anext__() for g in gens]
    assert all(not f.finished for f in firsts)
    await engine.abort("a0")
    rest = [o async for o in gens[0]]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    await engine.abort("no-such-request")  # no-op
    await gens[1].aclose()  # leaving a stream early aborts its request
    await engine.abort("a2")
    assert (await gens[2].__anext__()).outputs[0].finish_reason == "abort"
    for _ in range(3):
        await asyncio.sleep(0.05)
    pool = engine.core.scheduler.pool
    assert not engine.core.scheduler.requests and pool.num_free_blocks == pool.num_blocks
    assert engine.core.scheduler.slots.num_free_slots == 4
    engine.core.check_integrity()


@pytest.mark.parametrize(
    "prompt, params, error, match",
    [
        ({"prompt_token_ids": [1, 10**6]}, GREEDY, InvalidPromptError, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * 600}, GREEDY, InvalidPromptError, "max_model_len"),
        ({"prompt_token_ids": []}, GREEDY, InvalidPromptError, "empty"),
        ({"tokens": [1]}, GREEDY, InvalidPromptError, "prompt_token_ids"),
        ("hi", SamplingParams(structured_outputs={"json": "{not json"}), StructuredOutputError, "JSON schema"),
        ("hi", SamplingParams(structured_outputs={"regex": "(unclosed"}), StructuredOutputError, "regex"),
    ],
)
async def test_bad_input_raises_one_line_value_error_on_first_anext(engine, prompt, params, error, match):
    gen = engine.generate(prompt, params, request_id="bad")
    with pytest.raises(error, match=match) as info:
        await gen.__anext__()
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert not engine.core.has_unfinished_requests()
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)


async def test_engine_client_protocol_stats_and_overload(model_dir):
    eng = await AsyncEngine.start(model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=1,
                                  max_num_waiting=1, served_model_name="tiny")
    try:
        assert isinstance(eng, EngineClient)
        info = eng.model_info
        assert (info.name, info.max_model_len, info.vocab_size, info.eos_token_ids) == ("tiny", 512, 4096, (1,))
        await eng.check_health()
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        running = eng.generate({"prompt_token_ids": PROMPT}, long, request_id="run")
        await running.__anext__()  # admitted: the only slot is taken
        queued = eng.generate({"prompt_token_ids": PROMPT}, long, request_id="wait")
        queued_task = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0.05)
        stats = eng.stats()
        assert (stats.num_running, stats.num_waiting, stats.max_num_waiting) == (1, 1, 1)
        assert 0 < stats.kv_cache_usage <= 1
        with pytest.raises(EngineOverloadedError):
            await eng.generate({"prompt_token_ids": PROMPT}, GREEDY, request_id="third").__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await eng.generate({"prompt_token_ids": PROMPT}, GREEDY, request_id="run").__anext__()
        await eng.abort("run")
        await eng.abort("wait")
        assert (await queued_task).outputs[0].finish_reason == "abort"
        # a shared 256-token prefix: the second request hits the prefix cache
        shared = [(7 * i) % 4000 + 10 for i in range(256)]
        first, _ = await collect(eng, {"prompt_token_ids": shared + [3]}, GREEDY, "p1")
        second, _ = await collect(eng, {"prompt_token_ids": shared + [4]}, GREEDY, "p2")
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 256
        assert 0 < eng.stats().prefix_cache_hit_rate < 1
    finally:
        await eng.shutdown()
    with pytest.raises(EngineDeadError):
        await eng.check_health()
    with pytest.raises(EngineDeadError):
        await eng.generate({"prompt_token_ids": PROMPT}, GREEDY).__anext__()
    await eng.shutdown()  # idempotent


async def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine):
    runner = engine.core.runner
    real_execute = runner.execute
    num_failures = {"left": 1}

    def flaky(batch):
        if num_failures["left"] > 0 and batch.num_tokens > 1:
            num_failures["left"] -= 1
            raise RuntimeError("device fell over\nsecond line")
        return real_execute(batch)

    runner.execute = flaky
    with pytest.raises(EngineStepError, match="device fell over") as info:
        await collect(engine, {"prompt_token_ids": PROMPT}, GREEDY, "f1")
    assert "\n" not in str(info.value)
    await engine.check_health()
    out, _ = await collect(engine, {"prompt_token_ids": PROMPT}, GREEDY, "f2")
    assert len(out.outputs[0].token_ids) == 8
    pool = engine.core.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and engine.num_failed_steps == 1

    runner.execute = lambda batch: (_ for _ in ()).throw(RuntimeError("always broken"))
    for i in range(3):
        with pytest.raises((EngineStepError, EngineDeadError)):
            await collect(engine, {"prompt_token_ids": PROMPT}, GREEDY, f"d{i}")
    with pytest.raises(EngineDeadError, match="always broken"):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await engine.generate({"prompt_token_ids": PROMPT}, GREEDY).__anext__()


async def test_the_loop_answers_pings_during_a_long_real_step(model_dir):
    eng = await AsyncEngine.start(model=str(model_dir), dtype="float32", max_model_len=4096, max_num_seqs=2,
                                  max_num_batched_tokens=4096)
    try:
        runner = eng.core.runner
        durations: list[float] = []
        real_execute = runner.execute

        def timed(batch):
            t = time.perf_counter()
            try:
                return real_execute(batch)
            finally:
                durations.append(time.perf_counter() - t)

        runner.execute = timed
        lags: list[float] = []
        done = False

        async def ping():
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        pinger = asyncio.create_task(ping())
        # long enough that one prefill step takes well over 0.3 s on the CPU kernels (1,500 tokens
        # took 0.24 s once the indexer skipped contexts it keeps whole)
        long_prompt = [(13 * i) % 4000 + 10 for i in range(3500)]
        await collect(eng, {"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=2, temperature=0.0), "long")
        done = True
        await pinger
        assert max(durations) > 0.3, durations  # a long step really ran
        assert len(lags) > 30
        # 9 pings in 10 are answered within 10 ms (a shared 2-core machine deschedules the odd one)
        assert sorted(lags)[int(0.9 * len(lags))] < 0.010, sorted(lags)[-5:]
    finally:
        await eng.shutdown()


def test_runs_under_uvloop(model_dir):
    uvloop = pytest.importorskip("uvloop")

    async def main():
        eng = await AsyncEngine.start(model=str(model_dir), max_model_len=256)
        try:
            return await collect(eng, {"prompt_token_ids": PROMPT}, GREEDY, "u")
        finally:
            await eng.shutdown()

    out, _ = uvloop.run(main())
    assert len(out.outputs[0].token_ids) == 8


async def test_a_crash_outside_the_model_step_fails_streams_and_marks_the_engine_dead(engine):
    def broken_invariant():
        raise AssertionError("free + cached + used != total")

    engine.core.check_integrity = broken_invariant  # the engine runs it after every step
    with pytest.raises(EngineDeadError, match="free \\+ cached"):
        await collect(engine, {"prompt_token_ids": PROMPT}, GREEDY, "c")
    with pytest.raises(EngineDeadError, match="step loop stopped"):
        await engine.check_health()


async def test_kv_host_tier_from_engine_options(model_dir, monkeypatch):
    """kv_host_tier_bytes (or DEEPINFER_KV_HOST_TIER_BYTES) gives the engine a host KV tier: a prompt
    whose blocks left the device pool is served from host memory with the same tokens."""
    from deepinfer import envs
    from deepinfer.cache.kv_tiers import TIER_HOST

    monkeypatch.setattr(envs, "_snapshot", envs.load({"DEEPINFER_KV_HOST_TIER_BYTES": str(64 << 20)}))
    eng = await AsyncEngine.start(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512,
                                  max_num_seqs=2, block_size=128, kv_load_deadline_s=2.0)
    offload = eng.core.kv_offload
    try:
        assert offload is not None and offload.tiers.host is not None and offload.config.load_deadline_s == 2.0
        prompt = {"prompt_token_ids": [(i * 7 + 3) % 4000 for i in range(300)]}  # 2 full blocks can hit
        first, _ = await collect(eng, prompt, GREEDY, "h1")
        await eng._loop.run_in_executor(eng._device, lambda: None)  # the idle copy-outs ran
        assert offload.wait_for_writes(10)
        eng.core.scheduler.pool.evict_all_unreferenced()  # gone from the device pool, kept on the host
        again, _ = await collect(eng, prompt, GREEDY, "h2")
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert again.metrics.cached_tokens_by_tier[TIER_HOST] == 256
    finally:
        await eng.shutdown()
    assert offload._closed  # built with the engine: closed with it
