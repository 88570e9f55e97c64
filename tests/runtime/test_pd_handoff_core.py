"""Engine-side handoff on real tiny DeepSeek-V4 cores in one process: a request prefilled on one
core and continued on another (KV exported, copied, imported) produces exactly the tokens,
text and logprobs a single co-located core produces — greedy, seeded, penalties, resumed."""

from __future__ import annotations

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import (
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
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

helpers = load_test_helper("runtime/pd_core_helpers")
assert_same_outputs, mixed_requests, run_to_end = helpers.assert_same_outputs, helpers.mixed_requests, helpers.run_to_end


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pd")
    write_tiny_model(path, seed=5, layers="WCHC")
    return path


def _core(model_dir, **kw):
    opts = EngineOptions(dtype="float32", device="cpu", max_num_seqs=kw.pop("max_num_seqs", 8), block_size=128,
                         max_model_len=1024, num_blocks=kw.pop("num_blocks", 64), **kw)
    return build_engine(model_dir, opts).core


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


@pytest.mark.timeout(300)
def test_prefill_then_decode_equals_colocated(model_dir):
    colocated, prefill, decode = _core(model_dir), _core(model_dir), _core(model_dir)
    vocab = colocated.config.vocab_size
    reqs = mixed_requests(8, seed=11, vocab=vocab, prompt_lens=((5, 60), (120, 300)), max_tokens=(6, 8),
                          prompt_logprobs=True)
    for rid, prompt, params, seed in reqs:
        add_resumed(colocated, rid, prompt, params, seed, [])
    want = run_to_end(colocated)

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
    for rid, out in run_to_end(decode).items():
        got[rid] = merge_output(got[rid], out)
    prefill.check_integrity()
    assert not prefill.has_unfinished_requests()
    assert_same_outputs(got, want, [r[0] for r in reqs])


@pytest.mark.timeout(300)
def test_resumed_request_continues_the_same_stream(model_dir):
    """A request that lost its decode engine after k tokens resumes on a prefill with those k
    tokens as outputs and continues exactly (same positions, penalties, seed)."""
    colocated, prefill, decode = _core(model_dir), _core(model_dir), _core(model_dir)
    prompt = list(range(40, 75))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, frequency_penalty=0.4, ignore_eos=True)
    add_resumed(colocated, "a", prompt, params, 3, [])
    want = run_to_end(colocated)["a"].outputs[0]
    k = 4
    capture = KvCapture()
    first, kv, payload = _prefill(prefill, capture, "a", prompt, params, 3, resumed=want.token_ids[:k])
    assert first.outputs[0].token_ids == [want.token_ids[k]]  # the primed tokens are not re-sent
    assert kv.num_computed_tokens == len(prompt) + k
    pre = PrefilledRequest("a", prompt, want.token_ids[: k + 1], params, 3, kv.num_computed_tokens, payload)
    delta = admit_prefilled(decode, pre)
    rest = run_to_end(decode)["a"]
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
