"""The gateway driven by the official ``openai`` client over a real loopback server.

Every test here runs once per engine in ENGINE_FACTORIES (the FakeEngine now; the integrator adds
the real tiny-model engine), so they assert only what any engine must satisfy.
"""

import openai
import pytest

from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")

LONG_PROMPT = " ".join(["the model cache of the server keeps every prefix block"] * 12)


@pytest.fixture(params=sorted(harness.ENGINE_FACTORIES))
async def served(request):
    """(gateway, engine, AsyncOpenAI client) for one engine kind."""
    async with harness.ENGINE_FACTORIES[request.param]() as engine:
        async with harness.running_gateway(engine) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                yield gateway, engine, client
            finally:
                await client.close()


def _model(engine):
    return engine.model_info.name


async def test_models_lists_the_engine_model(served):
    _, engine, client = served
    models = await client.models.list()
    assert [m.id for m in models.data] == [_model(engine)]
    assert models.data[0].model_extra["max_model_len"] == engine.model_info.max_model_len


async def test_completion_usage_and_stream_match(served):
    _, engine, client = served
    prompt = "Hello, the model"
    full = await client.completions.create(model=_model(engine), prompt=prompt, max_tokens=12, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    expected_prompt = len(engine.tokenizer.encode(prompt))
    assert full.usage.prompt_tokens == expected_prompt
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == expected_prompt + 12
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    assert full.object == "text_completion" and full.id.startswith("cmpl-")

    stream = await client.completions.create(model=_model(engine), prompt=prompt, max_tokens=12, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    texts, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        texts.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(texts) == choice.text  # greedy: streaming and not agree
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == expected_prompt


async def test_chat_usage_counts_the_templated_prompt(served):
    _, engine, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prefix cache?"}]
    resp = await client.chat.completions.create(model=_model(engine), messages=messages, max_tokens=8,
                                                temperature=0.0)
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


async def test_chat_stream_equals_non_stream_for_a_seed(served):
    _, engine, client = served
    kw = dict(model=_model(engine), messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=16,
              temperature=1.0, seed=1234)
    full = await client.chat.completions.create(**kw)
    stream = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    roles, parts, finish, usage = [], [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        parts.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


async def test_seed_reproducible_and_n_fans_out_with_derived_seeds(served):
    _, engine, client = served
    kw = dict(model=_model(engine), prompt="Once upon a time", max_tokens=10, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = await client.completions.create(**kw, seed=7)
    b = await client.completions.create(**kw, seed=7)
    c = await client.completions.create(**kw, seed=8)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    many = await client.completions.create(**kw, seed=7, n=3)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a.choices[0].text  # choice i uses seed + i
    assert many.choices[1].text == c.choices[0].text
    assert many.usage.completion_tokens == 30
    assert many.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once


async def test_chat_logprobs_shape(served):
    _, engine, client = served
    resp = await client.chat.completions.create(model=_model(engine), messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        if "\ufffd" not in entry.token:  # a byte fragment shows as U+FFFD; its bytes are the raw ones
            assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
    # greedy: the chosen token is the most likely one
    assert all(e.token == e.top_logprobs[0].token for e in content)
    # the tokens' bytes spell the text
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert text == resp.choices[0].message.content


async def test_completion_logprobs_shape(served):
    _, engine, client = served
    resp = await client.completions.create(model=_model(engine), prompt="the cache", max_tokens=6, temperature=0.7,
                                           seed=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3  # the top 2, plus the sampled token when it is not among them
        assert top[tok] == tok_lp
    if not any("\ufffd" in t for t in lp.tokens):
        assert "".join(lp.tokens) == resp.choices[0].text


async def test_cached_tokens_on_repeated_long_prompt(served):
    _, engine, client = served
    kw = dict(model=_model(engine), prompt=LONG_PROMPT, max_tokens=2, temperature=0.0)
    first = await client.completions.create(**kw)
    second = await client.completions.create(**kw)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


async def test_stop_string_truncates(served):
    _, engine, client = served
    kw = dict(model=_model(engine), prompt="Counting words", max_tokens=24, temperature=0.0,
              extra_body={"ignore_eos": True})
    free = (await client.completions.create(**kw)).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = free[: free.index(stop)]
    for stream in (False, True):
        if stream:
            parts, finish = [], None
            async for chunk in await client.completions.create(**kw, stop=[stop], stream=True):
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            text = "".join(parts)
        else:
            resp = await client.completions.create(**kw, stop=[stop])
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == cut and finish == "stop"


async def test_batch_prompts_and_token_id_prompts(served):
    _, engine, client = served
    ids = engine.tokenizer.encode("the server")
    resp = await client.completions.create(model=_model(engine), prompt=[ids, ids[:2]], max_tokens=3, n=2,
                                           temperature=0.0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == len(ids) + 2
    assert resp.choices[0].text == resp.choices[1].text  # greedy: n copies agree


async def test_unknown_model_is_404(served):
    _, _, client = served
    with pytest.raises(openai.NotFoundError) as info:
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.body["param"] == "model"
    assert "no-such-model" in info.value.body["message"]


async def test_max_tokens_past_context_is_400(served):
    _, engine, client = served
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=_model(engine), messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=engine.model_info.max_model_len)
    assert info.value.body["param"] == "max_tokens"
    assert info.value.body["code"] == "context_length_exceeded"


async def test_streamed_choices_of_n_match_non_streamed(served):
    _, engine, client = served
    kw = dict(model=_model(engine), messages=[{"role": "user", "content": "three ways"}], max_tokens=10,
              temperature=1.0, seed=99, n=3)
    full = await client.chat.completions.create(**kw)
    parts, finishes, roles = {0: [], 1: [], 2: []}, {}, []
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(roles) == [0, 1, 2]
    for c in full.choices:
        assert "".join(parts[c.index]) == c.message.content
        assert finishes[c.index] == c.finish_reason
