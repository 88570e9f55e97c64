"""DSpark in disaggregated serving: the decode engine drafts.

Real processes on loopback (``deepinfer node`` under the supervisor: 1 prefill + 1 decode) over the
trained tiny V4.1 shipped in the package, ``speculative="dspark"`` given to the cluster: the decode
engine speculates (its counters say it drafted, verified and accepted), the prefill engine does not,
and every greedy completion equals a co-located engine's without speculation, token for token. The
decode engine's context ring starts empty for a handed-off request (the prompt's features stayed on
the prefill engine) and fills from the positions it computes.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import add_resumed
from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.engine.text.tokenizer import Tokenizer
from deepinfer.runtime.disagg.launch import LocalPdCluster
from deepinfer.transport.protocol import PdStatusRequest
from tests.conftest import load_test_helper

run_to_end = load_test_helper("runtime/pd_core_helpers").run_to_end

ENGINE = dict(dtype="float32", block_size=16, max_model_len=384, num_blocks=256, max_num_seqs=4, num_threads=1)
NEW_TOKENS = 40

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(builtin_checkpoint() is None,
                                                            reason="the built-in checkpoint is not in this tree")]


def _prompts(model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(model_dir)
    headers = json.loads((model_dir / "heldout_headers.json").read_text())  # held-out function headers
    return [tok.encode(h["header"]) for h in headers[:6]]


def _colocated(model_dir, prompts) -> list[list[int]]:
    """The reference: a co-located engine in this process, no speculation, same options."""
    opts = {k: v for k, v in ENGINE.items() if k != "num_threads"}
    core = build_engine(model_dir, EngineOptions(**opts)).core
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        add_resumed(core, f"r{i}", prompt, params, 0, [])
    acc = run_to_end(core)
    return [acc[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_the_decode_engine_drafts_and_outputs_equal_colocated_without_speculation():
    model_dir = builtin_checkpoint()
    prompts = _prompts(model_dir)
    want = _colocated(model_dir, prompts)
    pd = LocalPdCluster(model_dir, num_prefill=1, num_decode=1,
                        engine_options=dict(ENGINE, speculative="dspark", spec_schedule="fixed"),
                        lease_s=30.0, request_timeout_s=240.0, heartbeat_interval_s=0.2)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def one(i, prompt):
        acc = None
        async for out in pd.client.generate({"prompt_token_ids": prompt}, params, request_id=f"pd-{i}"):
            acc = merge_output(acc, out)
        assert acc is not None and acc.finished
        return acc.outputs[0].token_ids

    async def go():
        await pd.start(ready_timeout_s=300)
        try:
            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            statuses = {}
            for name in pd.engine_names():
                entry = pd.client.directory.engines[name]
                statuses[name] = await entry.rpc.request(PdStatusRequest(), timeout_s=10.0)
            return got, statuses
        finally:
            await pd.close()

    got, statuses = asyncio.run(go())
    assert got == want
    decode, prefill = statuses["decode-0"].spec, statuses["prefill-0"].spec
    assert prefill == {}, prefill  # the prefill engine never drafts
    # fixed-5 drafts at every decode step of every request; the trained drafter gets some accepted
    assert decode["num_drafted"] > 0 and decode["num_verified"] > 0, decode
    assert 0 < decode["num_accepted"] <= decode["num_verified"], decode
