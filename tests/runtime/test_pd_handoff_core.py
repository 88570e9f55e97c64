"""Engine-side handoff on real tiny DeepSeek-V4 cores in one process: a request prefilled on one
core and continued on another (KV exported, copied, imported) produces exactly the tokens,
text and logprobs a single co-located core produces — greedy, seeded, penalties, resumed."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.engine_factory import EngineOptions, build_engine
from deepinfer.engine.handoff import (
    HandoffError,
    KvCapture,
    KvPayload,
    NoRoom,
    PrefilledRequest,
    add_resumed,
    admit_prefilled,
    ends_at_prefill,
    export_kv,
    prefill_params,
)
from deepinfer.engine.output_processor import merge_output
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pd")
    write_tiny_model(path, seed=5, layers="WCHC")
    return path


def _core(model_dir, **kw):
    opts = EngineOptions(dtype="float32", device="cpu", max_num_seqs=kw.pop("max_num_seqs", 8), block_size=128,
                         max_model_len=1024, num_blocks=kw.pop("num_blocks", 64), **kw)
    return build_engine(model_dir, opts).core


def _run_to_end(core, on_step=None, max_steps=500):
    acc = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        plan = core.schedule_step()
        if on_step is not None:
            on_step(plan)
        if plan.is_empty:
            continue
        for out in core.commit_step(plan, core.sample_step(plan, core.execute(plan))):
            acc[out.request_id] = merge_output(acc.get(out.request_id), out)
        core.check_integrity()
    return acc


def _prefill(core, capture, rid, prompt, params, seed, resumed=()):
    """One request through a prefill core; returns (finished output, captured kv)."""
    resumed = list(resumed)
    add_resumed(core, rid, prompt, prefill_params(params, len(resumed)), seed, resumed)
    capture.watch(rid)
    done = {}
    for _ in range(200):
        if rid in done and done[rid].finished:
            break
        plan = core.schedule_step()
        capture.on_scheduled(plan, core.config.scheduler.block_size)
        if plan.is_empty:
            continue
        for out in core.commit_step(plan, core.sample_step(plan, core.execute(plan))):
            done[out.request_id] = merge_output(done.get(out.request_id), out)
            if out.finished and out.request_id == rid:
                kv = capture.take(rid)
                return done[rid], kv, export_kv(core.runner, kv)
    raise AssertionError("prefill did not finish")


def _requests(vocab, num):
    rng = random.Random(11)
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([rng.randint(5, 60), rng.randint(120, 300)]))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0.7, seed=7 + i, max_tokens=7, presence_penalty=0.5,
                                    frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, prompt_logprobs=1, logprobs=1)
        reqs.append((f"r{i}", prompt, params, 1000 + i))
    return reqs


@pytest.mark.timeout(300)
def test_prefill_then_decode_equals_colocated(model_dir):
    colocated, prefill, decode = _core(model_dir), _core(model_dir), _core(model_dir)
    vocab = colocated.config.vocab_size
    reqs = _requests(vocab, 8)
    for rid, prompt, params, seed in reqs:
        add_resumed(colocated, rid, prompt, params, seed, [])
    want = _run_to_end(colocated)

    capture = KvCapture()
    got = {}
    max_len = prefill.config.scheduler.max_model_len
    for rid, prompt, params, seed in reqs:
        first, kv, payload = _prefill(prefill, capture, rid, prompt, params, seed)
        toks = first.outputs[0].token_ids
        assert kv.num_computed_tokens == len(prompt) and len(kv.block_ids) == -(-len(prompt) // 128)
        if ends_at_prefill(first, params, len(toks), len(prompt) + len(toks), max_len):
            got[rid] = first
            continue
        pre = PrefilledRequest(rid, prompt, toks, params, seed, kv.num_computed_tokens,
                               KvPayload(payload.names, [t.clone() for t in payload.tensors]),
                               kv.window_start, kv.write_from, first.outputs[0].logprobs, first.prompt_logprobs)
        delta = admit_prefilled(decode, pre)
        assert delta is not None and delta.outputs[0].token_ids == toks
        got[rid] = delta
    for rid, out in _run_to_end(decode).items():
        got[rid] = merge_output(got[rid], out)
    prefill.check_integrity()
    assert not prefill.has_unfinished_requests()
    for rid, *_ in reqs:
        w, g = want[rid].outputs[0], got[rid].outputs[0]
        assert g.token_ids == w.token_ids, rid
        assert g.text == w.text, rid
        assert g.finish_reason == w.finish_reason, rid
        if w.logprobs is not None:
            assert [sorted(p) for p in g.logprobs] == [sorted(p) for p in w.logprobs], rid
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-5), rid
        if want[rid].prompt_logprobs is not None:
            assert got[rid].prompt_logprobs == want[rid].prompt_logprobs, rid


@pytest.mark.timeout(300)
def test_resumed_request_continues_the_same_stream(model_dir):
    """A request that lost its decode engine after k tokens resumes on a prefill with those k
    tokens as outputs and continues exactly (same positions, penalties, seed)."""
    colocated, prefill, decode = _core(model_dir), _core(model_dir), _core(model_dir)
    prompt = list(range(40, 75))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, frequency_penalty=0.4, ignore_eos=True)
    add_resumed(colocated, "a", prompt, params, 3, [])
    want = _run_to_end(colocated)["a"].outputs[0]
    k = 4
    capture = KvCapture()
    first, kv, payload = _prefill(prefill, capture, "a", prompt, params, 3, resumed=want.token_ids[:k])
    assert first.outputs[0].token_ids == [want.token_ids[k]]  # the primed tokens are not re-sent
    assert kv.num_computed_tokens == len(prompt) + k
    pre = PrefilledRequest("a", prompt, want.token_ids[: k + 1], params, 3, kv.num_computed_tokens, payload)
    delta = admit_prefilled(decode, pre)
    rest = _run_to_end(decode)["a"]
    assert delta.outputs[0].token_ids + rest.outputs[0].token_ids == want.token_ids[k:]


def test_no_room_and_bad_layout_leave_the_decode_core_untouched(model_dir):
    prefill, decode = _core(model_dir), _core(model_dir, max_num_seqs=1, num_blocks=4)
    capture = KvCapture()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reqs = []
    for rid in ("x", "y"):
        first, kv, payload = _prefill(prefill, capture, rid, list(range(10, 30)), params, 1)
        reqs.append(PrefilledRequest(rid, list(range(10, 30)), first.outputs[0].token_ids, params, 1,
                                     kv.num_computed_tokens, payload))
    admit_prefilled(decode, reqs[0])
    with pytest.raises(NoRoom):
        admit_prefilled(decode, reqs[1])
    decode.check_integrity()
    assert set(decode.scheduler.requests) == {"x"}
    bad = reqs[1]
    bad.kv = KvPayload(bad.kv.names[1:], bad.kv.tensors[1:])
    decode.abort(["x"])
    with pytest.raises(HandoffError, match="differ from this engine's layout"):
        admit_prefilled(decode, bad)
    decode.check_integrity()
    assert not decode.has_unfinished_requests()
    with pytest.raises(HandoffError, match="computed tokens"):
        PrefilledRequest("z", [1, 2, 3], [4], params, 0, 2, bad.kv)
