"""An image request handed from a prefill core to a decode core (tiny V4.1, float32 CPU, one
process): the image embeddings ride with the KV, so the decode core continues exactly like the
co-located core, and when it is preempted and recomputes the prompt (image positions included)
it still does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import (
    HandoffError,
    KvCapture,
    PrefilledRequest,
    add_resumed,
    admit_prefilled,
    export_kv,
    prefill_params,
    split_image_embeddings,
    with_image_embeddings,
)
from deepinfer.engine.mm.prompt import ImagePrompt
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

helpers = load_test_helper("runtime/pd_core_helpers")
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16, num_blocks=128, max_num_seqs=4)


def _parts(tiny_dir, **kw):
    return build_engine(tiny_dir, EngineOptions(**{**OPTIONS, **kw}))


def _prefill(core, rid, ids, params, seed, mm):
    capture = KvCapture()
    add_resumed(core, rid, ids, prefill_params(params, 0), seed, [], mm)
    capture.watch(rid)
    acc = None
    for _ in range(200):
        plan = core.schedule_step()
        capture.on_scheduled(plan, core.config.scheduler.block_size)
        if plan.is_empty:
            continue
        for out in core.commit_step(plan, core.sample_step(plan, core.execute(plan))):
            acc = merge_output(acc, out)
            if out.finished:
                kv = capture.take(rid)
                return acc, kv, export_kv(core.runner, kv)
    raise AssertionError("prefill did not finish")


@pytest.mark.timeout(120)
def test_image_request_survives_handoff_and_decode_preemption(tiny_dir):
    parts = _parts(tiny_dir)
    vision = parts.vision
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (100, 130, 3), dtype=np.uint8))
    text = [5, 17, vision.image_token_id] + list(range(40, 70))
    prompt = ImagePrompt.build(vision, text, [image])
    mm = prompt.inputs([vision.encode(p) for p in prompt.images])
    ids = prompt.token_ids
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    parts.core.add_request("c", ids, params, mm_inputs=mm)
    want = helpers.run_to_end(parts.core)["c"].outputs[0].token_ids

    prefill = _parts(tiny_dir).core
    first, kv, payload = _prefill(prefill, "r", ids, params, 0, mm)
    payload = with_image_embeddings(payload, mm)
    assert payload.names[-1] == "e.0"
    wire = type(payload)(payload.names, [t.clone() for t in payload.tensors])  # what the transfer delivers
    kv_only, images = split_image_embeddings(wire, [m.span for m in mm])
    assert images[0].embeds.equal(mm[0].embeds) and not any(n.startswith("e.") for n in kv_only.names)
    with pytest.raises(HandoffError, match=r"embeddings \[\] for 1 image span"):
        split_image_embeddings(kv_only, [m.span for m in mm])

    # the decode core without a prefix cache: a preempted request recomputes every position
    decode = _parts(tiny_dir, enable_prefix_caching=False).core
    toks = first.outputs[0].token_ids
    pre = PrefilledRequest("r", ids, toks, params, 0, kv.num_computed_tokens, kv_only, kv.window_start, kv.write_from,
                           mm_inputs=images)
    got = admit_prefilled(decode, pre)
    for _ in range(3):  # a few decode steps on the imported KV
        for out in helpers.sync_steps.step(decode):
            got = merge_output(got, out)
    sched = decode.scheduler
    sched.preempt(sched.requests["r"], SimpleNamespace(preempted_ids=[]), SimpleNamespace(preempted_ids=set()))
    for out in helpers.run_to_end(decode).values():
        got = merge_output(got, out)
    assert sched.num_preemptions == 1
    assert got.outputs[0].token_ids == want
