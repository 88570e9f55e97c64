"""The engine serves V4.1 checkpoints like V4's: LLM (parity with the plain reference through the
whole engine), AsyncEngine batching, prefix-cache hits, the KV store and the P/D handoff."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from deepinfer import LLM, AsyncEngine, SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import KvCapture, PrefilledRequest, add_resumed, admit_prefilled, export_kv, prefill_params
from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

plain = load_test_helper("engine/v41/plain_v41")
pd = load_test_helper("runtime/pd_core_helpers")

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16, max_num_seqs=4)


def _prompts(num, seed, lo=20, hi=140):
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), **OPTIONS)


def test_llm_teacher_forced_parity_with_plain_reference(llm, tiny_dir):
    """Prompt logprobs and the 32 greedy tokens' logprobs from the engine vs one plain pass."""
    reference = plain.PlainV41(tiny_dir)
    prompt = _prompts(1, 3, 90, 90)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0))[0]
    gen = out.outputs[0]
    seq = prompt + gen.token_ids
    served = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    served += [lp[t].logprob for lp, t in zip(gen.logprobs, gen.token_ids)]
    ref = torch.log_softmax(reference.logits(seq)[:-1], -1)
    realised = ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert (torch.tensor(served) - realised).abs().max().item() < 1e-3
    assert gen.token_ids == ref[len(prompt) - 1 :].argmax(-1).tolist()


def test_prefix_hit_equals_miss_and_is_counted(llm):
    prompt = _prompts(1, 4, 300, 300)[0]  # past sliding_window x layers: the replay starts after 0
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    cold = llm.generate({"prompt_token_ids": prompt}, params)[0]
    warm = llm.generate({"prompt_token_ids": prompt + [7, 8]}, params)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert warm.num_cached_tokens >= 288 and again.num_cached_tokens >= 288
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert again.outputs[0].logprobs == cold.outputs[0].logprobs


def test_async_engine_batched_requests_equal_each_alone(tiny_dir, llm):
    prompts = _prompts(6, 5)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=10, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(6)]
    alone = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]

    async def together():
        engine = await AsyncEngine.start(model=str(tiny_dir), **OPTIONS)
        try:
            async def one(p, sp):
                tokens = []
                async for out in engine.generate({"prompt_token_ids": p}, sp):
                    tokens += out.outputs[0].token_ids  # streamed deltas
                return tokens

            return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        finally:
            await engine.shutdown()

    assert asyncio.run(together()) == alone


def test_kv_store_serves_a_second_engine(tiny_dir, tmp_path):
    """Blocks written behind to a filesystem store by one engine are a prefix hit for another."""
    prompt = _prompts(1, 6, 200, 200)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = LLM(model=str(tiny_dir), kv_store_dir=str(tmp_path / "store"), **OPTIONS)
    want = first.generate({"prompt_token_ids": prompt}, params)[0]
    second = LLM(model=str(tiny_dir), kv_store_dir=str(tmp_path / "store"), **OPTIONS)
    got = second.generate({"prompt_token_ids": prompt}, params)[0]
    assert got.num_cached_tokens >= 176 and got.outputs[0].token_ids == want.outputs[0].token_ids


def _core(tiny_dir):
    return build_engine(tiny_dir, EngineOptions(**OPTIONS, num_blocks=96)).core


def test_pd_handoff_equals_colocated(tiny_dir):
    """Prefill on one engine core, export the KV (blocks + SWA slot), admit it on another core and
    decode there: the same tokens, text and logprobs as one co-located core."""
    colocated, prefill, decode = _core(tiny_dir), _core(tiny_dir), _core(tiny_dir)
    reqs = pd.mixed_requests(4, seed=2, vocab=480, prompt_lens=((20, 60), (100, 180)), max_tokens=(5, 8))
    for rid, prompt, params, seed in reqs:
        add_resumed(colocated, rid, prompt, params, seed, [])
    want = pd.run_to_end(colocated)
    capture, got = KvCapture(), {}
    for rid, prompt, params, seed in reqs:
        add_resumed(prefill, rid, prompt, prefill_params(params, 0), seed, [])
        capture.watch(rid)
        first = kv = None
        while kv is None:
            plan = prefill.schedule_step()
            capture.on_scheduled(plan, prefill.config.scheduler.block_size)
            if plan.is_empty:
                continue
            for out in prefill.commit_step(plan, prefill.sample_step(plan, prefill.execute(plan))):
                first = merge_output(first, out) if out.request_id == rid else first
                if out.request_id == rid and out.finished:
                    kv = capture.take(rid)
        payload = export_kv(prefill.runner, kv)
        pre = PrefilledRequest(rid, prompt, first.outputs[0].token_ids, params, seed, kv.num_computed_tokens, payload,
                               kv.window_start, kv.write_from, first.outputs[0].logprobs, first.prompt_logprobs)
        got[rid] = admit_prefilled(decode, pre)
    for rid, out in pd.run_to_end(decode).items():
        got[rid] = merge_output(got[rid], out)
    pd.assert_same_outputs(got, want, [r[0] for r in reqs])


def test_bounded_replay_replays_the_encoder_and_bounds_the_decoder(tiny_dir):
    """swa_replay="bounded" on V4.1: a prefix hit replays sliding_window x (layers below the CED
    source) tokens through the encoder and only the last swa_replay_tokens through the decoder
    layers; the state is approximate (kept out of the prefix cache) but stays near the exact one."""
    prompt = _prompts(1, 7, 300, 300)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for mode in ("exact", "bounded"):
        parts = build_engine(tiny_dir, EngineOptions(**OPTIONS, num_blocks=96, swa_replay=mode, swa_replay_tokens=16))
        core = parts.core
        add_resumed(core, "a", prompt, params, 1, [])
        pd.run_to_end(core)
        add_resumed(core, "b", prompt + [7, 8], params, 1, [])
        outs[mode] = pd.run_to_end(core)["b"]
        assert outs[mode].num_cached_tokens == 288
    stats = parts.swa_slots.stats
    c = parts.model_config
    assert stats.num_replayed_bounded == 1 and stats.num_replayed_tokens == c.sliding_window * c.ced_source
    exact, bounded = outs["exact"].outputs[0], outs["bounded"].outputs[0]
    assert bounded.token_ids[:4] == exact.token_ids[:4]
    lp = [abs(e[t].logprob - b[t].logprob) for e, b, t in zip(exact.logprobs, bounded.logprobs, exact.token_ids[:4])]
    assert max(lp) < 0.1, lp


def test_slot_store_restores_a_continued_conversation(tiny_dir):
    """A finished sequence's SWA slot (windows, the open ratio-2 pair, the Engram history) is saved
    at its last block boundary and restored when the conversation continues, with no replay: with
    lossless window rows the continuation equals a cold run exactly (the slot is the whole state)."""
    from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
    from deepinfer.engine.core.hooks import EngineHooks
    from deepinfer.engine.kv.swa_slots import build_swa_slots
    from deepinfer.engine.sched.scheduler import SchedulerConfig

    loaded = load_v41_checkpoint(tiny_dir)
    runner = ModelRunner(loaded.config, loaded.tensors, num_blocks=96, num_slots=4, block_size=16)
    sched = SchedulerConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=1024,
                            model_id="tiny-v41")
    parts = build_swa_slots(runner, sched, mode="exact", num_store_slots=4, is_window_mxfp8=False)
    core = EngineCore(parts.runner, EngineCoreConfig(parts.scheduler, num_blocks=96, vocab_size=loaded.config.vocab_size),
                      seed_rng=random.Random(0), hooks=EngineHooks(swa_slots=parts.manager))
    first = _prompts(1, 8, 140, 140)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    add_resumed(core, "a", first, params, 1, [])
    turn1 = pd.run_to_end(core)["a"].outputs[0].token_ids
    follow = first + turn1 + [9, 10, 11]
    add_resumed(core, "b", follow, params, 1, [])
    warm = pd.run_to_end(core)["b"]
    stats = parts.manager.stats
    assert stats.num_saved >= 1 and stats.num_restored == 1 and stats.num_replayed_tokens == 0
    cold = build_engine(tiny_dir, EngineOptions(**OPTIONS, num_blocks=96, enable_prefix_caching=False)).core
    add_resumed(cold, "b", follow, params, 1, [])
    want = pd.run_to_end(cold)["b"].outputs[0]
    assert warm.num_cached_tokens == 144
    got = warm.outputs[0]
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in p.items()} for p in got.logprobs] == \
        [{t: lp.logprob for t, lp in p.items()} for p in want.logprobs]  # bit for bit


def test_a_prompt_with_the_image_token_but_no_image_is_refused(llm, tiny_dir):
    """Image tokens come only from images: a prompt holding one without an image is a one-line error."""
    from deepinfer.engine.api.llm import LLMError
    from deepinfer.engine.models.deepseek_v41.config import V41Config

    image = V41Config.from_dir(tiny_dir).image_token_id
    with pytest.raises(LLMError, match=f"holds the image token {image} but no image"):
        llm.generate({"prompt_token_ids": [5, 6, image, 7]}, SamplingParams(max_tokens=2))
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids
