"""DSpark in the engine, end to end on the trained tiny V4.1 checkpoint (its real drafter).

64 random requests (held-out function headers behind a shared preamble, so later requests hit
the prefix cache; greedy and seeded-sampled; some under a regex or a JSON schema; max_tokens
8..32) through ``LLM`` with speculation off, with the confidence schedule and with fixed-5
verification: every request's tokens are identical across the three runs (greedy: the argmax;
sampled: the counter-based draw of (seed, position), so equal tokens for every seed mean equal
output distributions), drafts were really accepted (multi-token commits, rollbacks of the
rejected rest), the confidence schedule verified fewer drafts than fixed-5, and prefix hits and
structured output were in the mix. Bad speculation options are one-line errors. Through the real
gateway: /metrics carries the engine's DSpark totals and each finished request's drafted /
verified / accepted counts, which add up to the totals.
"""

from __future__ import annotations

import json
import random
import re

import aiohttp
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.api.llm import LLMError
from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import BUILTIN_DIR, builtin_checkpoint
from tests.conftest import load_test_helper

gateway_harness = load_test_helper("runtime/gateway_harness")

pytestmark = pytest.mark.skipif(builtin_checkpoint() is None, reason="the trained tiny checkpoint is not in this tree")

NUM_REQUESTS = 64
PREAMBLE = "# Utilities of the standard library, reimplemented.\nimport os\nimport sys\nimport re\n\n\n"
REGEX = r"    return [a-z_]+\([a-z_, ]*\)\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
ENGINE = dict(max_num_seqs=16, block_size=16, max_model_len=512, seed=0, num_threads=1, json_any_whitespace=False)


def _requests():
    rng = random.Random(24)
    headers = [h["header"] for h in json.loads((BUILTIN_DIR / "heldout_headers.json").read_text())]
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        prompt = (PREAMBLE if rng.random() < 0.7 else "") + rng.choice(headers)
        kind = rng.random()
        sampled = rng.random() < 0.4
        kw = dict(max_tokens=rng.randint(8, 32))
        kw.update(temperature=rng.choice((0.6, 1.0)), top_p=rng.choice((1.0, 0.9)), seed=1000 + i) if sampled \
            else kw.update(temperature=0.0)
        if kind < 0.12:
            kw["structured_outputs"] = {"regex": REGEX}
        elif kind < 0.2:
            kw["structured_outputs"] = {"json": SCHEMA}
            prompt = "# a record as JSON\n"
        prompts.append(prompt)
        params.append(SamplingParams(**kw))
    return prompts, params


def _run(prompts, params, pad=False, **spec):
    """``pad``: verify steps padded to token buckets, as an engine replaying CUDA graphs pads them."""
    llm = LLM(str(BUILTIN_DIR), **ENGINE, **spec)
    try:
        if pad:
            llm.engine.core.spec.pad_to_buckets = True
        outs = llm.generate(prompts, params)
        engine = llm.engine
        stats = engine.core.spec.stats if engine.core.spec is not None else None
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], stats, engine.stats()
    finally:
        llm.shutdown()


@pytest.mark.timeout(180)
def test_dspark_on_equals_off_token_for_token():
    torch.set_num_threads(1)
    prompts, params = _requests()
    off, texts, _, off_engine = _run(prompts, params)
    sched, _, st_sched, _ = _run(prompts, params, speculative="dspark", spec_schedule="confidence")
    fixed, _, st_fixed, _ = _run(prompts, params, speculative="dspark", spec_schedule="fixed")
    padded, _, st_padded, _ = _run(prompts, params, pad=True, speculative="dspark", spec_schedule="confidence")
    for i, (a, b, c, d) in enumerate(zip(off, sched, fixed, padded)):
        assert a == b, f"request {i} ({params[i]}): confidence schedule differs from no speculation"
        assert a == c, f"request {i} ({params[i]}): fixed-5 differs from no speculation"
        assert a == d, f"request {i} ({params[i]}): verify steps padded to buckets differ from no speculation"
    assert st_padded.num_verified > st_sched.num_verified  # the buckets were filled with more drafts
    # the mix really held what it claims
    assert off_engine.prefix_cache_hit_rate and off_engine.prefix_cache_hit_rate > 0.2
    for text, p in zip(texts, params):
        so = p.structured_outputs
        if so and "regex" in so and len(text) and text.endswith("\n"):
            assert re.fullmatch(REGEX, text), text
    assert sum(p.structured_outputs is not None for p in params) >= 5
    assert sum(p.temperature > 0 for p in params) >= 16
    # drafts were accepted (multi-token commits) and rejected (rollbacks); fixed verifies all 5
    for st in (st_sched, st_fixed):
        assert st.num_accepted > 0 and st.num_verified > st.num_accepted, st
    assert st_fixed.num_verified > 0 and st_sched.num_verified < st_fixed.num_verified, (st_sched, st_fixed)


@pytest.mark.parametrize("bad, message", [
    (dict(speculative="eagle"), "speculative must be one of off, dspark"),
    (dict(speculative="dspark", spec_schedule="greedy"), "spec_schedule must be one of confidence, throughput, fixed"),
    (dict(speculative="dspark", num_draft_tokens=0), "num_draft_tokens must be an integer >= 1"),
    (dict(speculative="dspark", num_draft_tokens=6), "needs lookahead >= 7"),
])
def test_bad_speculation_options_are_one_line_errors(bad, message):
    with pytest.raises(LLMError, match=re.escape(message)) as info:
        LLM(str(BUILTIN_DIR), **ENGINE, **bad)
    assert "\n" not in str(info.value)


def _sample(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert found, f"{name} not on /metrics"
    return float(found.group(1))


@pytest.mark.timeout(120)
async def test_metrics_carry_totals_and_per_request_counts():
    from deepinfer.engine.api.async_engine import AsyncEngine

    torch.set_num_threads(1)
    engine = await AsyncEngine.start(model=str(BUILTIN_DIR), served_model_name="tiny", speculative="dspark",
                                     **{k: v for k, v in ENGINE.items() if k != "json_any_whitespace"})
    try:
        async with gateway_harness.running_gateway(engine) as gateway, aiohttp.ClientSession() as http:
            for header in ("def fibonacci(n):\n", "class Stack:\n", "def add(a, b):\n"):
                body = {"model": "tiny", "prompt": header, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
                async with http.post(f"{gateway.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get(f"{gateway.url}/metrics") as resp:
                text = await resp.text()
    finally:
        await engine.shutdown()
    totals = engine.stats().spec
    assert totals["num_accepted"] > 0
    for name in ("drafted", "verified", "accepted"):
        assert _sample(text, f"deepinfer_spec_{name}_total") == totals[f"num_{name}"]
        # every draft of these three requests was counted once, on its request's finishing output
        assert _sample(text, f'deepinfer_spec_request_tokens_sum{{stage="{name}"}}') == totals[f"num_{name}"]
        assert _sample(text, f'deepinfer_spec_request_tokens_count{{stage="{name}"}}') == 3


def test_serve_flags_reach_the_engine_options():
    import argparse

    from deepinfer.bin import serve
    from deepinfer.engine.core.options import EngineOptions

    sub = argparse.ArgumentParser().add_subparsers()
    parser = serve.add_parser(sub, "serve")
    args = parser.parse_args(["--speculative", "dspark", "--num-draft-tokens", "3", "--spec-schedule", "fixed"])
    opts = serve.engine_options(args)
    assert opts == {"speculative": "dspark", "num_draft_tokens": 3, "spec_schedule": "fixed"}
    assert EngineOptions(**opts).num_draft_tokens == 3
    assert serve.engine_options(parser.parse_args([])) == {}  # the engine's defaults (off) apply
