"""Third-party clients against a real ``deepinfer serve`` (the built-in random tiny model): the
official ``openai`` SDK (tool calling, reasoning, the Responses API, echo), langchain-openai
``bind_tools``, litellm tools, and lm-eval's ``local-completions`` (a multiple-choice task scored
by loglikelihood and a generate-until task, from task files written here: no downloads).

One server serves the whole module; lm-eval's import is the slow part, done once.
"""

import concurrent.futures
import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from tests.conftest import free_port, load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")
pytestmark = pytest.mark.timeout(300)
MODEL = "deepinfer-tiny"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FLAG = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_flag", "description": "Turn the flag on or off", "parameters": FLAG}}]
SCHEMAS = {"get_weather": WEATHER, "set_flag": FLAG}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def server():
    model_dir = harness.tiny_model_dir()
    with proc.Served(["--max-model-len", "2048"], proc.serve_env(harness.TEST_CACHE_DIR), free_port()) as served:
        served.model_dir = model_dir
        yield served


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


# ---- tool calling ---------------------------------------------------------------------------------
def test_required_tool_calls_validate_30_of_30(client):
    # 15 choices in one response, 15 streamed, one call each (several per choice: langchain and litellm
    # below, and tests/runtime/test_tool_calls.py), served side by side
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, model=MODEL, messages=ASK, tools=TOOLS,
                            tool_choice="required", parallel_tool_calls=False, n=15, temperature=1.0, seed=1)
        streamed = pool.submit(lambda: list(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=15,
            temperature=1.0, seed=2, stream=True)))
        resp, chunks = whole.result(), streamed.result()
    calls_by_choice: dict[int, dict[int, list]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                slot = calls_by_choice.setdefault(ch.index, {}).setdefault(d.index, [None, None, ""])
                if d.id is not None:
                    assert slot[0] is None, "a call's id comes once"
                    slot[0], slot[1] = d.id, d.function.name
                slot[2] += d.function.arguments or ""
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    valid = 0
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls and all(c.id.startswith("call_") for c in choice.message.tool_calls)
        valid += bool(_valid_calls(choice.message.tool_calls))
    for index, calls in calls_by_choice.items():
        assert finish[index] == "tool_calls" and len(calls) == 1  # parallel_tool_calls=false: one call
        for _, (call_id, name, arguments) in sorted(calls.items()):
            assert call_id.startswith("call_")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        valid += 1
    assert valid == 30


def test_named_tool_none_and_a_tool_result_continues(client):
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "set_flag"}})
    msg = named.choices[0].message
    assert [name for name, _ in _valid_calls(msg.tool_calls)] == ["set_flag"]
    assert named.choices[0].finish_reason == "stop"  # as OpenAI: a named tool_choice stops
    call = msg.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "flag is on"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, seed=4)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > named.usage.prompt_tokens  # the call and its result are in the prompt
    plain = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, seed=4)
    assert isinstance(plain.choices[0].message.content, str) and plain.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=[*ASK, {"role": "tool", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_content_split_whole_and_streamed(client):
    # a grammar writes the thought and the answer, so the random model's split is known
    body = {"chat_template_kwargs": {"thinking": True}, "structured_outputs": {"grammar": 'root ::= "ab c</think>The end"'}}
    resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=body)
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("ab c", "The end")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=body, stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == ("ab c", "The end")
    # reasoning_effort is the same switch when chat_template_kwargs says nothing
    effort = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, reasoning_effort="high",
                                            extra_body={"structured_outputs": body["structured_outputs"]})
    assert (effort.choices[0].message.reasoning_content, effort.choices[0].message.content) == ("ab c", "The end")
    # thinking off (the template's default): the same text is all content
    off = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body={
        "structured_outputs": {"grammar": 'root ::= "ab c</think>The end"'}})
    assert off.choices[0].message.content == "ab c</think>The end"


# ---- the Responses API -------------------------------------------------------------------------------
def test_responses_create_and_stream(client):
    r = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=6, temperature=0.0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    forced = client.responses.create(model=MODEL, input=[{"role": "user", "content": "weather?"}], tools=tools,
                                     tool_choice="required", temperature=1.0)
    calls = [o for o in forced.output if o.type == "function_call"]
    assert calls and forced.status == "completed"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    # a function result continues the conversation, statelessly
    follow = client.responses.create(
        model=MODEL, max_output_tokens=4, tools=tools,
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > forced.usage.input_tokens
    # the SDK's stream helper folds the events into the response (a JSON format makes it complete)
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG}}
    done = client.responses.create(model=MODEL, input="Say hi", text=fmt, temperature=0.0)
    assert done.status == "completed" and json.loads(done.output_text) in ({"on": True}, {"on": False})
    with client.responses.stream(model=MODEL, input="Say hi", text=fmt, temperature=0.0) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-1] == "response.completed" and "response.output_text.delta" in types
    assert final.output_text == done.output_text  # greedy: the same text as the complete response
    events = list(client.responses.create(model=MODEL, input="Say hi", max_output_tokens=6, temperature=0.0,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text and [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == ("response.incomplete" if r.status == "incomplete" else "response.completed")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")


# ---- request ids and request fields -------------------------------------------------------------------
def test_every_response_carries_a_request_id(client, server):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, max_tokens=2)
    generated = raw.headers["x-request-id"]
    assert len(generated) == 32
    mine = client.with_options(default_headers={"X-Request-Id": "job-17.a"})
    assert mine.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1).headers[
        "x-request-id"] == "job-17.a"
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=ASK, max_tokens=2,
                                                               stream=True) as streamed:
        assert len(streamed.headers["x-request-id"]) == 32
    with pytest.raises(openai.NotFoundError) as err:
        mine.chat.completions.create(model="nope", messages=ASK)
    assert err.value.response.headers["x-request-id"] == "job-17.a"
    bad = client.with_options(default_headers={"X-Request-Id": "evil\tid"})
    assert bad.models.with_raw_response.list().headers["x-request-id"] != "evil\tid"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{server.url}/v1/nothing-here")
    assert len(missing.value.headers["x-request-id"]) == 32


def test_wrong_types_are_400_unknown_fields_are_ignored(client):
    for field, value in (("store", "yes"), ("metadata", [1]), ("user", 5), ("parallel_tool_calls", "no")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body={field: value})
        assert err.value.body["param"] == field
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                        extra_body={"an_unknown_field": {"any": "thing"}, "store": False})
    assert ok.choices[0].finish_reason in ("length", "stop")


# ---- echo, prompt logprobs -------------------------------------------------------------------------
def test_echo_and_score_only(client):
    prompt = "The cache of the server"
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == scored.usage.prompt_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    one = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0.0)
    c1 = one.choices[0]
    assert c1.text.startswith(prompt) and len(c1.logprobs.tokens) == len(lp.tokens) + 1
    assert c1.logprobs.token_logprobs[: len(lp.tokens)] == lp.token_logprobs
    assert c1.logprobs.text_offset[len(lp.tokens)] == sum(len(t) for t in lp.tokens)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                            temperature=0.0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == c1.text
    ext = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    positions = ext.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(lp.tokens)
    ids = client.completions.create(model=MODEL, prompt=[[5, 99, 100]], echo=True, max_tokens=0).choices[0]
    assert ids.finish_reason == "length" and ids.logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


# ---- langchain-openai and litellm ----------------------------------------------------------------------
def test_langchain_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      temperature=1.0, seed=5, timeout=120)
    bound = llm.bind_tools(TOOLS, tool_choice="required")
    ai = bound.invoke([HumanMessage("weather in Paris?")])
    assert ai.tool_calls and all(c["name"] in SCHEMAS for c in ai.tool_calls)
    for c in ai.tool_calls:
        jsonschema.validate(c["args"], SCHEMAS[c["name"]])
    streamed = None
    for piece in bound.stream([HumanMessage("weather in Paris?")]):
        streamed = piece if streamed is None else streamed + piece
    assert streamed.tool_calls and all(jsonschema.validate(c["args"], SCHEMAS[c["name"]]) is None
                                       for c in streamed.tool_calls)
    answer = llm.bind_tools(TOOLS).invoke([HumanMessage("weather in Paris?"), ai,
                                           *[ToolMessage("sunny", tool_call_id=c["id"]) for c in ai.tool_calls]],
                                          max_tokens=4)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_litellm_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price map: no download
    litellm = pytest.importorskip("litellm")
    resp = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused", messages=ASK,
                              tools=TOOLS, tool_choice="required", temperature=1.0, seed=6, timeout=120)
    calls = resp.choices[0].message.tool_calls
    assert calls and _valid_calls(calls)
    assert resp.choices[0].finish_reason == "tool_calls"


# ---- lm-eval ---------------------------------------------------------------------------------------
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_DOCS = [
    {"question": "Which one is a colour?", "choices": ["red", "seven", "under"], "answer": 0},
    {"question": "What comes after one?", "choices": ["blue", "two"], "answer": 1},
    {"question": "Where is the model cache kept?", "choices": ["on the store", "in a tree", "nowhere"], "answer": 0},
]
GEN_DOCS = [{"question": "Count: one two", "answer": " three"}, {"question": "The server", "answer": " runs"}]


def test_lm_eval_local_completions(server, client, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    for var, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets")), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(var, value)
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name, task, docs in (("mc", MC_TASK, MC_DOCS), ("gen", GEN_TASK, GEN_DOCS)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(task.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server.url}/v1/completions", "model": MODEL, "tokenizer": str(server.model_dir),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
                    "max_length": 2048},
        tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, cache_requests=False)
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["tiny_gen"]["exact_match,none"] <= 1.0
    # what lm-eval scored equals the engine's own prompt logprobs for the same tokens
    from transformers import AutoTokenizer

    from deepinfer import LLM, SamplingParams

    hf = AutoTokenizer.from_pretrained(server.model_dir)
    scored = []  # (what lm-eval got, the prompt ids, where the continuation starts)
    for sample in results["samples"]["tiny_mc"]:
        for i, (context, continuation) in enumerate(sample["arguments"]):
            ctx_ids = hf(context, add_special_tokens=False).input_ids
            ids = ctx_ids + hf(context + continuation, add_special_tokens=False).input_ids[len(ctx_ids):]
            scored.append((sample["resps"][i][0][0], ids, len(ctx_ids)))
    assert len(scored) == sum(len(d["choices"]) for d in MC_DOCS)
    llm = LLM(model=str(server.model_dir), device="cpu", max_model_len=2048)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in scored],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))
        for (got, ids, start), out in zip(scored, outs):
            want = sum(out.prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids)))
            assert got == pytest.approx(want, abs=1e-6)
    finally:
        llm.shutdown()
    # its generations are the server's greedy text up to the first newline
    gen = results["samples"]["tiny_gen"]
    assert len(gen) == len(GEN_DOCS)
    for sample in gen:
        context, kwargs = sample["arguments"][0]
        want = client.completions.create(model=MODEL, prompt=[hf(context, add_special_tokens=False).input_ids],
                                         max_tokens=6, temperature=0.0, stop=kwargs["until"]).choices[0].text
        assert sample["resps"][0][0] == want
