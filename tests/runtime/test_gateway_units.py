"""Pure pieces of the gateway: parameter mapping, logprob formats, error translation, embedding."""

import asyncio
import json
import math
import shlex

import aiohttp
import msgspec
import pytest

from deepinfer.engine.api.outputs import Logprob
from deepinfer.runtime.gateway import GatewayConfig, curl_example, serve
from deepinfer.runtime.gateway.engine_inputs import decide_max_tokens, json_depth, structured_spec, template_messages
from deepinfer.runtime.gateway.errors import GatewayError, from_decode_error, from_engine_error
from deepinfer.runtime.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, decode_request
from deepinfer.runtime.gateway.openai_responses import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")


def _chat(**fields):
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_json_depth_is_iterative_and_stops_early():
    assert json_depth(1, 10) == 0
    assert json_depth({"a": [1, {"b": []}]}, 10) == 4
    nested = []
    for _ in range(100000):  # far past the recursion limit
        nested = [nested]
    assert json_depth(nested, 64) == 65


def test_structured_spec_spellings():
    assert structured_spec(_chat()) is None
    assert structured_spec(_chat(response_format={"type": "text"})) is None
    spec = structured_spec(_chat(structured_outputs={"choice": ["a", 'b"c', "d\\e"]}))
    assert spec.param == "structured_outputs.choice"
    assert spec.spec == {"grammar": 'root ::= "a" | "b\\"c" | "d\\\\e"'}
    assert structured_spec(_chat(guided_json='{"type": "string"}')).spec == {"json": {"type": "string"}}
    assert structured_spec(_chat(guided_choice=["x"])).param == "guided_choice"
    with pytest.raises(GatewayError) as info:
        structured_spec(_chat(guided_regex="a", structured_outputs={"regex": "b"}))
    assert info.value.status == 400 and "only one" in info.value.message
    with pytest.raises(GatewayError) as info:
        structured_spec(_chat(guided_json="[1, 2]"))
    assert info.value.status == 422 and info.value.param == "guided_json"


def test_decide_max_tokens():
    assert decide_max_tokens(10, None, "max_tokens", 16, 100, "prompt") == 16
    assert decide_max_tokens(90, None, "max_tokens", 16, 100, "prompt") == 10  # default clipped to the context
    assert decide_max_tokens(10, None, "max_tokens", None, 100, "messages") == 90
    assert decide_max_tokens(10, 90, "max_tokens", 16, 100, "prompt") == 90
    with pytest.raises(GatewayError) as info:
        decide_max_tokens(10, 91, "max_completion_tokens", 16, 100, "messages")
    assert info.value.param == "max_completion_tokens" and "at most 90" in info.value.message
    with pytest.raises(GatewayError) as info:
        decide_max_tokens(100, None, "max_tokens", 16, 100, "messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"


def _names(token_id, decoded):
    return decoded if decoded is not None else f"<{token_id}>"


def test_chat_logprobs_rank_order_and_floor():
    pos = {7: Logprob(-2.0, 3, "c"), 5: Logprob(-0.1, 1, None), 6: Logprob(-1.0, 2, "b"),
           9: Logprob(-math.inf, 4, "z")}
    [entry] = chat_logprobs([7], [pos], 2, _names)
    assert (entry.token, entry.logprob, entry.bytes) == ("c", -2.0, [99])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("<5>", -0.1), ("b", -1.0)]
    [masked] = chat_logprobs([9], [pos], 0, _names)
    assert masked.logprob == LOGPROB_FLOOR and masked.top_logprobs == []
    assert chat_logprobs([8], [pos], 2, _names) == []  # the engine did not report the sampled token


def test_completion_logprobs_offsets_and_sampled_token():
    positions = [{1: Logprob(-0.5, 1, "ab"), 2: Logprob(-1.5, 2, "x")},
                 {3: Logprob(-0.2, 1, "c"), 4: Logprob(-3.0, 5, "dd")}]
    lp, end = completion_logprobs([1, 4], positions, 1, _names, text_offset=10)
    assert lp.tokens == ["ab", "dd"]
    assert lp.token_logprobs == [-0.5, -3.0]
    assert lp.top_logprobs == [{"ab": -0.5}, {"c": -0.2, "dd": -3.0}]  # the sampled one is always listed
    assert lp.text_offset == [10, 12] and end == 14


def test_decode_errors_name_the_field():
    def err(body, kind=CompletionRequest):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError, RecursionError)) as info:
            decode_request(body, kind)
        return from_decode_error(info.value)

    e = err(b'{"prompt": "x", "n": 0}')
    assert (e.status, e.param, e.code) == (400, "n", "invalid_value") and e.message.startswith("n: expected")
    e = err(b'{"prompt": "x", "stream": "yes"}')
    assert (e.param, e.code) == ("stream", "invalid_type")
    e = err(b'{"n": 1}')
    assert (e.param, e.code, e.message) == ("prompt", "missing_required_parameter", "prompt is required")
    e = err(b'{"prompt": "x", "stream_options": {"x": 1}}')
    assert e.param == "stream_options.x" and e.code == "unknown_parameter"
    e = err(b'{"prompt": ')
    assert e.param is None and e.code == "invalid_json"


def test_engine_errors_map_to_statuses():
    from deepinfer.engine.api.sampling_params import SamplingParamsError
    from deepinfer.engine.sample.structured_output import StructuredOutputError
    from deepinfer.runtime.gateway import EngineOverloadedError

    e = from_engine_error(StructuredOutputError("invalid regex: unbalanced"), "structured_outputs.regex")
    assert (e.status, e.param) == (422, "structured_outputs.regex")
    assert e.message == "structured_outputs.regex: invalid regex: unbalanced"
    e = from_engine_error(SamplingParamsError("top_p must be in (0, 1], got 2"), None)
    assert (e.status, e.param) == (400, "top_p")
    e = from_engine_error(EngineOverloadedError(retry_after_s=2.4), None)
    assert (e.status, e.headers) == (429, {"Retry-After": "2"})
    assert from_engine_error(RuntimeError("boom"), None) is None  # not an input error: a 5xx, logged


def test_template_messages():
    req = decode_request(json.dumps({"messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bo"},
    ]}).encode(), ChatCompletionRequest)
    assert template_messages(req.messages) == [{"role": "system", "content": "rules"},
                                               {"role": "user", "content": "a\nb", "name": "bo"}]


def test_curl_example_is_a_valid_command():
    line = curl_example("http://127.0.0.1:8000", "tiny", needs_api_key=True)
    argv = shlex.split(line.replace("$DEEPINFER_API_KEY", "k"))
    assert argv[:3] == ["curl", "-N", "http://127.0.0.1:8000/v1/chat/completions"]
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "tiny" and body["stream"] is True
    assert "Authorization: Bearer k" in argv


async def test_serve_prints_url_and_curl_then_stops():
    engine = harness.fake_engine()
    lines, stop = [], asyncio.Event()
    task = asyncio.create_task(serve(engine, host="127.0.0.1", port=0, api_key="key", print_fn=lines.append,
                                     stop=stop))
    while len(lines) < 3:
        await asyncio.sleep(0.01)
    url = lines[0].split(" at ")[1].split(" ")[0]
    assert url.startswith("http://127.0.0.1:") and "fake-tiny" in lines[0]
    assert lines[2].strip().startswith("curl -N " + url)
    async with aiohttp.ClientSession() as session:
        body = json.loads(shlex.split(lines[2])[-1])
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers={"Authorization": "Bearer key"}) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
    stop.set()
    await asyncio.wait_for(task, 5)
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"{url}/health")


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="api_key"):
        GatewayConfig(api_key="  ")
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewayConfig(max_body_bytes=10)


class _Scripted:
    """An EngineClient stand-in that replays fixed deltas (or raises) per request id suffix."""

    def __init__(self, scripts):
        self.scripts = scripts  # choice index -> list of RequestOutput | Exception
        self.aborted = []

    def generate(self, prompt, params, *, request_id):
        script = self.scripts[int(request_id.rsplit("-", 1)[1])]

        async def stream():
            for item in script:
                await asyncio.sleep(0)
                if isinstance(item, Exception):
                    raise item
                yield item
            await asyncio.Event().wait()  # a script without a finished output hangs like a busy engine

        return stream()

    async def abort(self, request_id):
        self.aborted.append(request_id)


def _delta(text, finish=None):
    from deepinfer.engine.api.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [5] if text else [], finish_reason=finish)],
                         finished=finish is not None)


def _generation(engine, n):
    from deepinfer.engine.api.sampling_params import SamplingParams
    from deepinfer.runtime.gateway.generation import EngineRequest, Generation
    from deepinfer.runtime.gateway.metrics import GatewayMetrics

    class _Stats:
        def stats(self):
            from deepinfer.runtime.gateway import EngineStats

            return EngineStats()

    requests = [EngineRequest(i, 0, f"req-{i}", [1], SamplingParams(max_tokens=4)) for i in range(n)]
    return Generation(engine, requests, GatewayMetrics(_Stats()), arrival_time=0.0)


async def test_generation_merges_choices_and_signals_ready_deltas():
    engine = _Scripted({0: [_delta("a"), _delta("b", "stop")], 1: [_delta("x"), _delta("", "length")]})
    gen = _generation(engine, 2)
    seen, num_ready = [], 0
    try:
        await gen.start()
        deltas = gen.deltas().__aiter__()
        while True:
            is_ready = gen.has_ready
            step = asyncio.ensure_future(deltas.__anext__())
            await asyncio.sleep(0)
            if is_ready:  # promised: the next delta needs no wait, so handlers may hold their writes
                assert step.done()
                num_ready += 1
            try:
                choice, delta = await step
            except StopAsyncIteration:
                break
            seen.append((choice.index, delta.text, delta.finish_reason))
    finally:
        await gen.close()
    assert num_ready >= 1
    assert sorted(seen) == [(0, "a", None), (0, "b", "stop"), (1, "", "length"), (1, "x", None)]
    assert [c.text for c in gen.choices] == ["ab", "x"]
    assert gen.usage_counts() == (1, 3, 0)  # one prompt counted once; three tokens
    assert engine.aborted == []


async def test_generation_start_error_aborts_the_siblings():
    from deepinfer.engine.sample.structured_output import StructuredOutputError

    engine = _Scripted({0: [_delta("a")], 1: [StructuredOutputError("invalid regex: x")]})
    gen = _generation(engine, 2)
    with pytest.raises(GatewayError) as info:
        await gen.start()
    await gen.close()
    assert info.value.status == 422
    assert engine.aborted == ["req-0", "req-1"]  # the failed one too: a no-op for the engine by contract


async def test_generation_close_aborts_what_is_still_running():
    engine = _Scripted({0: [_delta("a")], 1: [_delta("b"), _delta("c", "stop")]})
    gen = _generation(engine, 2)
    await gen.start()
    async for choice, _ in gen.deltas():
        if choice.index == 1 and choice.finish_reason:
            break
    await gen.close()
    assert engine.aborted == ["req-0"]
