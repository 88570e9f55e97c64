"""Bad input, limits, auth, aborts and the operational endpoints, against the FakeEngine."""

import asyncio
import json

import aiohttp
import pytest

from deepinfer.runtime.gateway import EngineOverloadedError, EngineStats, GatewayConfig
from deepinfer.runtime.gateway.config import STATE_KEY
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


async def _post(session, url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.read()


def _error(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.fixture
async def gw():
    engine = harness.fake_engine(max_model_len=256)
    async with harness.running_gateway(engine) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            yield session, engine


DEEP = {"type": "object"}
for _ in range(100):
    DEEP = {"type": "object", "properties": {"a": DEEP}}

# (path, body, status, param)
BAD_REQUESTS = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[]", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, 400,
     "messages[0].tool_calls"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 100000}, 400, "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    (CHAT, {"messages": HI, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": HI, "top_k": -2}, 400, "top_k"),
    (CHAT, {"messages": HI, "min_p": 2}, 400, "min_p"),
    (CHAT, {"messages": HI, "presence_penalty": 3}, 400, "presence_penalty"),
    (CHAT, {"messages": HI, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CHAT, {"messages": HI, "n": 0}, 400, "n"),
    (CHAT, {"messages": HI, "n": 17}, 400, "n"),
    (CHAT, {"messages": HI, "seed": 2**64}, 400, "seed"),
    (CHAT, {"messages": HI, "seed": "x"}, 400, "seed"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (CHAT, {"messages": HI, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": HI, "stop": ["x"] * 17}, 400, "stop"),
    (CHAT, {"messages": HI, "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    (CHAT, {"messages": HI, "model": "gpt-9"}, 404, "model"),
    (CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": HI, "stream": True, "stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    (CHAT, {"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 422,
     "response_format"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": DEEP}}}, 400, "response_format"),
    (CHAT, {"messages": HI, "structured_outputs": {"regex": "(ab"}}, 422, "structured_outputs.regex"),
    (CHAT, {"messages": HI, "structured_outputs": {}}, 400, "structured_outputs"),
    (CHAT, {"messages": HI, "structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, 400,
     "structured_outputs.regex"),
    (CHAT, {"messages": HI, "structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml"),
    (CHAT, {"messages": HI, "guided_grammar": "root ::= "}, 422, "guided_grammar"),
    (CHAT, {"messages": HI, "guided_json": "{not json"}, 422, "guided_json"),
    (CHAT, {"messages": HI, "guided_regex": "a+", "response_format": {"type": "json_object"}}, 400, "guided_regex"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400,
     "tools[0].function.name"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, 400,
     "tools[0].function.parameters"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    (CHAT, {"messages": HI, "store": "yes"}, 400, "store"),
    (CHAT, {"messages": HI, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"messages": HI, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (CHAT, {"messages": HI, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages"),
    (CHAT, b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "messages[0]"),
    (CHAT, b'{"metadata": ' + b"[" * 50000 + b"]" * 50000 + b', "messages": []}', 400, "metadata"),
    (CHAT, b'{"unknown": ' + b"[" * 50000 + b"]" * 50000 + b', "messages": []}', 400, None),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    (CMPL, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (CMPL, {"prompt": [999999]}, 400, "prompt"),
    (CMPL, {"prompt": [5] * 256}, 400, "prompt"),
    (CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": ["x"] * 9, "n": 8}, 400, "n"),
    (CMPL, {"prompt": "x", "echo": "yes"}, 400, "echo"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "x", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{'chat' if p == CHAT else 'cmpl'}-{s}" for i, (p, _, s, _) in enumerate(BAD_REQUESTS)])
async def test_bad_request_gets_openai_error_naming_the_field(gw, path, body, status, param):
    session, engine = gw
    got, _, raw = await _post(session, path, body)
    err = _error(raw)
    assert got == status, err
    assert err["param"] == param, err
    if param is not None:
        assert param.split(".")[0].split("[")[0] in err["message"]
    assert engine.num_live == 0


async def test_structured_outputs_reach_the_engine(gw):
    session, engine = gw
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, {"json": schema}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, {"grammar": 'root ::= "yes" | "no"'}),
        ({"structured_outputs": {"choice": ["yes", "no \"quoted\""]}}, {"grammar": 'root ::= "yes" | "no \\"quoted\\""'}),
        ({"guided_json": json.dumps(schema)}, {"json": schema}),
        ({"guided_regex": "\\d+"}, {"regex": "\\d+"}),
    ]
    for extra, expected in cases:
        status, _, raw = await _post(session, CHAT, {"messages": HI, "max_tokens": 2, **extra})
        assert status == 200, raw
        assert engine.requests[-1].params.structured_outputs == expected


async def test_sampling_fields_reach_the_engine(gw):
    session, engine = gw
    body = {"prompt": "hello", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 11,
            "stop": "zz", "stop_token_ids": [9], "min_tokens": 2, "ignore_eos": True, "logprobs": 3}
    status, _, raw = await _post(session, CMPL, body)
    assert status == 200, raw
    p = engine.requests[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (5, 0.5, 0.9, 7, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos, p.logprobs) == (11, ["zz"], [9], 2, True, 3)
    assert p.n == 1
    # chat: max_completion_tokens wins over max_tokens; default completion budget is the rest of the context
    await _post(session, CHAT, {"messages": HI, "max_tokens": 3, "max_completion_tokens": 4})
    assert engine.requests[-1].params.max_tokens == 4
    await _post(session, CHAT, {"messages": HI, "n": 1, "temperature": 0})
    prompt_len = len(engine.requests[-1].prompt_token_ids)
    assert engine.requests[-1].params.max_tokens == 256 - prompt_len
    await _post(session, CMPL, {"prompt": "hi"})
    assert engine.requests[-1].params.max_tokens == 16  # OpenAI's completions default


async def test_unknown_routes_methods_and_big_bodies_are_json():
    engine = harness.fake_engine()
    async with harness.running_gateway(engine, GatewayConfig(max_body_bytes=4096)) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            async with session.get(CMPL) as r:
                assert r.status == 405 and _error(await r.read())["code"] == "http_405"
            async with session.post("/v1/nope", data=b"{}") as r:
                assert r.status == 404 and _error(await r.read())["code"] == "http_404"
            status, _, raw = await _post(session, CMPL, {"prompt": "x" * 8000})
            assert status == 413 and "4096" in _error(raw)["message"]
            status, _, _ = await _post(session, CMPL, {"prompt": "small", "max_tokens": 1})
            assert status == 200


async def test_api_key():
    engine = harness.fake_engine()
    async with harness.running_gateway(engine, GatewayConfig(api_key="s3cret")) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            body = {"prompt": "x", "max_tokens": 1}
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
                status, hdrs, raw = await _post(session, CMPL, body, headers)
                assert status == 401 and _error(raw)["code"] == "invalid_api_key"
                assert hdrs["WWW-Authenticate"] == "Bearer"
            status, _, _ = await _post(session, CMPL, body, {"Authorization": "Bearer s3cret"})
            assert status == 200
            async with session.get("/v1/models") as r:
                assert r.status == 401
            for open_path in ("/health", "/version", "/metrics"):
                async with session.get(open_path) as r:
                    assert r.status == 200


async def test_queue_full_is_429_with_retry_after():
    engine = harness.fake_engine(max_running=1, max_waiting=1, step_delay_s=0.01)
    async with harness.running_gateway(engine) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            long = {"prompt": "x", "max_tokens": 30, "ignore_eos": True}
            first = asyncio.create_task(_post(session, CMPL, long))
            second = asyncio.create_task(_post(session, CMPL, long))
            while engine.stats().num_waiting < 1:
                await asyncio.sleep(0.005)
            status, headers, raw = await _post(session, CMPL, {"prompt": "x", "max_tokens": 1})
            assert status == 429 and headers["Retry-After"] == "1"
            assert _error(raw)["type"] == "rate_limit_error"
            assert [(await t)[0] for t in (first, second)] == [200, 200]


async def test_engine_overloaded_error_maps_to_429():
    class Racing(harness.FakeEngine):
        def stats(self):  # the gateway's pre-check sees room; the engine then refuses
            return EngineStats()

        async def generate(self, prompt, params, *, request_id):
            raise EngineOverloadedError("queue full", retry_after_s=3)
            yield  # pragma: no cover

    engine = Racing(harness.tiny_tokenizer())
    async with harness.running_gateway(engine) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            status, headers, raw = await _post(session, CHAT, {"messages": HI, "n": 3})
            assert status == 429 and headers["Retry-After"] == "3" and _error(raw)["code"] == "queue_full"


async def test_max_concurrent_requests_is_429():
    engine = harness.fake_engine(step_delay_s=0.02)
    async with harness.running_gateway(engine, GatewayConfig(max_concurrent_requests=1)) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            first = asyncio.create_task(_post(session, CMPL, {"prompt": "x", "max_tokens": 30, "ignore_eos": True}))
            while not engine.num_live:
                await asyncio.sleep(0.005)
            status, _, _ = await _post(session, CMPL, {"prompt": "x", "max_tokens": 1})
            assert status == 429
            assert (await first)[0] == 200


async def _wait_for(predicate, timeout=2.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_engine_request(stream):
    engine = harness.fake_engine(step_delay_s=0.05)
    async with harness.running_gateway(engine) as gateway:
        body = {"messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": stream, "n": 2}
        async with aiohttp.ClientSession(gateway.url) as session:
            if stream:
                async with session.post(CHAT, json=body) as r:
                    assert r.status == 200
                    line = await r.content.readline()
                    assert line.startswith(b"data: {")
                    r.close()  # drop the connection mid-stream
            else:
                task = asyncio.create_task(_post(session, CHAT, body))
                # both choices produced tokens (a cancel before that is a request never started,
                # which is aborted but not counted as a finished one)
                metrics = gateway.app[STATE_KEY].metrics
                await _wait_for(lambda: b"deepinfer_time_to_first_token_seconds_count 2.0" in metrics.render())
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        # the fake steps every 50 ms: the abort must land within a few steps, not at max_tokens (10 s)
        await _wait_for(lambda: engine.num_live == 0, timeout=1.0)
        ids = {r.request_id for r in engine.requests}
        assert set(engine.aborted) == ids and len(ids) == 2
        async with aiohttp.ClientSession(gateway.url) as session:
            async with session.get("/metrics") as r:
                assert 'deepinfer_requests_finished_total{finish_reason="abort"} 2.0' in await r.text()


async def test_engine_failure_mid_stream_is_reported_in_band():
    class Failing(harness.FakeEngine):
        async def generate(self, prompt, params, *, request_id):
            num = 0
            async for out in super().generate(prompt, params, request_id=request_id):
                yield out
                num += 1
                if num == 3:
                    raise RuntimeError("device lost")

    engine = Failing(harness.tiny_tokenizer())
    async with harness.running_gateway(engine) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            body = {"prompt": "x", "max_tokens": 20, "ignore_eos": True, "stream": True}
            async with session.post(CMPL, json=body) as r:
                assert r.status == 200
                events = [ln for ln in (await r.read()).split(b"\n\n") if ln]
            assert events[-1] == b"data: [DONE]"
            err = _error(events[-2].removeprefix(b"data: "))
            assert err["code"] == "engine_error" and "device lost" in err["message"]
            status, _, raw = await _post(session, CMPL, {**body, "stream": False})
            assert status == 503 and "device lost" in _error(raw)["message"]


async def test_health_version_models_metrics(gw):
    session, engine = gw
    async with session.get("/health") as r:
        assert r.status == 200 and (await r.json()) == {"status": "ok"}
    async with session.get("/version") as r:
        assert (await r.json())["version"]
    async with session.get("/v1/models/fake-tiny") as r:
        assert (await r.json())["id"] == "fake-tiny"
    async with session.get("/v1/models/other") as r:
        assert r.status == 404
    for _ in range(2):
        await _post(session, CMPL, {"prompt": "the model " * 10, "max_tokens": 5, "ignore_eos": True})
    async with session.get("/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["deepinfer_time_to_first_token_seconds_count"] == 2
    assert values["deepinfer_inter_token_latency_seconds_count"] == 8
    assert values["deepinfer_e2e_request_latency_seconds_count"] == 2
    assert values["deepinfer_generation_tokens_total"] == 10
    assert values['deepinfer_requests_finished_total{finish_reason="length"}'] == 2
    assert values["deepinfer_num_requests_running"] == 0
    assert values["deepinfer_num_requests_waiting"] == 0
    assert 0 < values["deepinfer_prefix_cache_hit_rate"] < 1
    assert values["deepinfer_cached_prompt_tokens_total"] > 0
    assert values['deepinfer_http_responses_total{code="200"}'] >= 2
    engine.is_healthy = False
    async with session.get("/health") as r:
        assert r.status == 503 and "unhealthy" in _error(await r.read())["message"]
