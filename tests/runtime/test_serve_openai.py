"""The real engine behind the gateway, driven by the official ``openai`` client: what only a real
engine can show (constrained decoding, batch-independent seeded sampling, real logprobs, the
prefix cache, aborts inside the engine). The engine-agnostic checks (usage, n fan-out, stop
strings, errors) run against both engines in test_gateway_openai.py.

One engine + gateway serves the whole module (loop scope "module") to keep it fast.
"""

import asyncio
import json
import math
import re

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
MODEL = "deepinfer-tiny"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "size", "ok", "kind"],
    "additionalProperties": False,
}
LONG_PROMPT = " ".join(["every block of this prompt is the same on the second request"] * 40)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    async with harness.tiny_engine_context() as engine:
        async with harness.running_gateway(engine) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
            try:
                yield gateway, engine, client
            finally:
                await client.close()


async def _wait_idle(engine, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while harness.num_live_requests(engine):
        assert loop.time() < deadline, f"engine still holds requests: {engine.stats()}"
        await asyncio.sleep(0.01)


async def _stream_chat(client, **kw) -> dict[int, tuple[str, str | None]]:
    """index -> (content, finish_reason) of a streamed chat completion."""
    parts: dict[int, list[str]] = {}
    finishes: dict[int, str | None] = {}
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    return {i: ("".join(p), finishes[i]) for i, p in parts.items()}


async def test_json_schema_output_validates_streamed_and_not(served):
    _, engine, client = served
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe an item as JSON."}], max_tokens=200,
              temperature=1.0, seed=10, n=4,
              response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}})
    full, streamed = await asyncio.gather(client.chat.completions.create(**kw), _stream_chat(client, **kw))
    finished = [c for c in full.choices if c.finish_reason == "stop"]
    # whitespace runs are bounded (MAX_JSON_WHITESPACE), so even a random model closes the object
    assert len(finished) == 4, [(c.finish_reason, c.message.content) for c in full.choices]
    for c in finished:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    for c in full.choices:  # seeded: the stream is the same text, choice by choice
        assert streamed[c.index] == (c.message.content, c.finish_reason)
    await _wait_idle(engine)


async def test_regex_and_choice_constrain_the_output_bad_regex_is_422(served):
    _, _, client = served
    regex = await client.completions.create(model=MODEL, prompt="id:", max_tokens=30, temperature=1.0, seed=1,
                                            extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2,4}"}})
    assert regex.choices[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{3}-[0-9]{2,4}", regex.choices[0].text), regex.choices[0].text
    choice = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                                  max_tokens=10, temperature=1.0, seed=2, n=3,
                                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert {c.message.content for c in choice.choices} <= {"red", "green"}
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                        extra_body={"structured_outputs": {"regex": "([a-z"}})
    assert info.value.body["param"] == "structured_outputs.regex"


async def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(served):
    _, engine, client = served
    kw = dict(model=MODEL, prompt="The cache server", max_tokens=12, temperature=0.9, top_p=0.95, seed=4242,
              logprobs=2, extra_body={"ignore_eos": True})
    alone = await client.completions.create(**kw)
    others = [client.completions.create(model=MODEL, prompt=f"other prompt {i} " * (i + 1), max_tokens=20,
                                        temperature=1.0, extra_body={"ignore_eos": True}) for i in range(5)]
    together, *_ = await asyncio.gather(client.completions.create(**kw), *others)
    assert together.choices[0].text == alone.choices[0].text
    a, b = alone.choices[0].logprobs, together.choices[0].logprobs
    assert a.tokens == b.tokens
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a.token_logprobs, b.token_logprobs))
    unseeded = await asyncio.gather(*[client.completions.create(**{**kw, "seed": None}) for _ in range(2)])
    assert unseeded[0].choices[0].text != unseeded[1].choices[0].text  # no seed: fresh randomness
    await _wait_idle(engine)


async def test_logprobs_are_real_log_probabilities(served):
    _, _, client = served
    resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5,
                                                extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    for entry in content:
        probs = [math.exp(t.logprob) for t in entry.top_logprobs]
        assert 0.0 < sum(probs) <= 1.0 + 1e-5  # the top 5 of one distribution
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)
    # the same positions streamed carry the same numbers
    streamed = []
    async for chunk in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0.0,
            logprobs=True, top_logprobs=5, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(math.isclose(s.logprob, e.logprob, abs_tol=1e-4) for s, e in zip(streamed, content))


async def test_repeated_long_prompt_reports_cached_tokens_in_stream_usage(served):
    _, engine, client = served
    ids = engine.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 2 * engine.core.config.scheduler.block_size  # at least two full blocks to reuse
    first = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0.0)
    usage = None
    async for chunk in await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2,
                                                       temperature=0.0, stream=True,
                                                       stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert first.usage.prompt_tokens == usage.prompt_tokens == len(ids)
    cached = usage.prompt_tokens_details.cached_tokens
    block = engine.core.config.scheduler.block_size
    assert 0 < cached < len(ids) and cached % block == 0  # whole blocks, never the last prompt token
    assert engine.stats().prefix_cache_hit_rate > 0


async def test_client_disconnect_mid_stream_aborts_in_the_engine(served):
    gateway, engine, _ = served
    body = {"model": MODEL, "prompt": "a very long story", "max_tokens": 1000, "stream": True, "ignore_eos": True,
            "n": 2}
    async with aiohttp.ClientSession(gateway.url) as session:
        async with session.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: {")
            assert engine.stats().num_running == 2
            resp.close()
    await _wait_idle(engine, timeout_s=3.0)  # aborted within steps, not after 1000 tokens
    async with aiohttp.ClientSession(gateway.url) as session:
        async with session.get("/metrics") as r:
            text = await r.text()
    assert re.search(r'^deepinfer_requests_finished_total\{finish_reason="abort"\} [1-9]', text, re.M), text
    assert "deepinfer_prefix_cache_hit_rate" in text and "deepinfer_kv_cache_usage" in text
    assert "deepinfer_swa_slots" not in text  # no slot store by default (tests/runtime/test_swa_serve.py has one)
