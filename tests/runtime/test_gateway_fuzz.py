"""Hypothesis fuzzing of the HTTP surface: >= 500 malformed or hostile requests.

Random JSON shapes, valid requests with fields replaced by wrong types / huge numbers / deep
nesting, raw bytes and invalid UTF-8, NaN literals, odd content types, giant strings near the body
limit, random paths and methods. Every answer must be a non-5xx; every error an OpenAI-format
JSON object; every stream must end with [DONE]; afterwards the server still answers /health and
no engine request is left behind. Examples are derandomized, so a run is reproducible.

Out of scope here: broken HTTP framing (control characters in header values, bad request lines,
bad chunking) is refused by the connection layer (runtime/gateway/connections.py) with a JSON 400
before any application code runs; tests/runtime/test_gateway_hostile.py covers it.
"""

import http.client
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.runtime.gateway import GatewayConfig
from deepinfer.runtime.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")

BODY_LIMIT = 64 * 1024
PATHS = ["/v1/completions", "/v1/chat/completions"]
CHAT_FIELDS = [f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest)]
CMPL_FIELDS = [f.encode_name for f in msgspec.structs.fields(CompletionRequest)]
def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SENT = {"count": 0}

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
           | st.sampled_from(["", "user", "assistant", "json_schema", "text", "regex", "[DONE]", "\u0000", "💥",
                              "{{ raise_exception('x') }}", "root ::= ", "(((", "gpt-4", "fake-tiny"])
           | st.integers(min_value=-2, max_value=300))
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=5)
                           | st.dictionaries(st.text(max_size=12), children, max_size=5), max_leaves=25)


def deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


# the same >= 500 requests against each engine: the FakeEngine (fast, every code path of the
# gateway) and the real AsyncEngine on the tiny model (the engine's own validation and aborts)
SERVER_FACTORIES = {
    "fake": lambda: harness.fake_engine(max_model_len=256, step_delay_s=0.0, prefill_delay_s=0.0),
    "tiny": lambda: harness.tiny_engine_context(max_model_len=256, max_num_seqs=16),
}


@pytest.fixture(scope="module", params=sorted(SERVER_FACTORIES))
def server(request):
    SENT.clear()
    SENT["count"] = 0
    with harness.ThreadedGateway(SERVER_FACTORIES[request.param], GatewayConfig(max_body_bytes=BODY_LIMIT)) as gw:
        yield gw


class Client:
    def __init__(self, port: int):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)

    def request(self, method: str, path: str, body: bytes | None, content_type: str | None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        SENT["count"] += 1
        try:
            self.conn.request(method, path, body=body, headers=headers)
            resp = self.conn.getresponse()
            data = resp.read()
        except (http.client.HTTPException, ConnectionError):
            self.conn.close()  # the server may close after an error; reconnect and retry once
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
            self.conn.request(method, path, body=body, headers=headers)
            resp = self.conn.getresponse()
            data = resp.read()
        return resp.status, resp.getheader("Content-Type") or "", data


@pytest.fixture(scope="module")
def client(server):
    c = Client(server.port)
    yield c
    c.conn.close()


def check(status: int, content_type: str, data: bytes) -> None:
    assert status < 500, (status, data[:300])
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type)
        body = json.loads(data)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif content_type.startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
    else:
        assert "choices" in json.loads(data), data[:300]


BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hello", "max_tokens": 4},
}


@st.composite
def mutated_requests(draw):
    """A valid request with 1-4 fields replaced by hostile values."""
    path = draw(st.sampled_from(PATHS))
    body = dict(BASE[path])
    names = CHAT_FIELDS if path.endswith("chat/completions") else CMPL_FIELDS
    for name in draw(st.lists(st.sampled_from(names + ["bogus", ""]), min_size=1, max_size=4)):
        body[name] = draw(json_values)
    raw = json.dumps(body).encode()
    if draw(st.booleans()) and b"1" in raw:  # sometimes a NaN / Infinity / huge literal (not JSON)
        raw = raw.replace(b"1", draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 400])), 1)
    return path, raw


@fuzz(260)
@given(req=mutated_requests(), stream=st.booleans())
def test_mutated_valid_requests(client, req, stream):
    path, raw = req
    if stream and raw.startswith(b"{"):
        raw = b'{"stream": true, ' + raw[1:] if raw != b"{}" else b'{"stream": true}'
    check(*client.request("POST", path, raw, "application/json"))


@fuzz(130)
@given(path=st.sampled_from(PATHS), value=json_values)
def test_random_json_shapes(client, path, value):
    check(*client.request("POST", path, json.dumps(value).encode(), "application/json"))


@st.composite
def hostile_bodies(draw):
    kind = draw(st.sampled_from(["bytes", "bad_utf8", "deep", "giant", "surrogate"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "bad_utf8":
        junk = draw(st.binary(min_size=1, max_size=8).filter(lambda b: not _is_utf8(b)))
        field = draw(st.sampled_from([b"prompt", b"model", b"stop", b"user"]))
        return b'{"' + field + b'": "ab' + junk + b'", "messages": [{"role": "user", "content": "x"}]}'
    if kind == "deep":
        depth = draw(st.integers(min_value=1, max_value=60000))
        field = draw(st.sampled_from(["prompt", "messages", "response_format", "structured_outputs", "metadata",
                                      "chat_template_kwargs", "guided_json", "logit_bias"]))
        return f'{{"{field}": {deep(depth, draw(st.sampled_from(["list", "dict"])))}, "prompt": "x"}}'.encode()
    if kind == "giant":
        size = draw(st.integers(min_value=1000, max_value=BODY_LIMIT + 4096))
        field = draw(st.sampled_from(["prompt", "model", "stop", "guided_regex", "user"]))
        return json.dumps({field: "a" * size, "messages": [{"role": "user", "content": "x"}]}).encode()
    # lone surrogates are valid JSON escapes but not valid text
    return b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}'


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@fuzz(160)
@given(path=st.sampled_from(PATHS + ["/v1/models", "/health", "/v1/../etc", "/v1/completions/x", "/%ff"]),
       method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH"]),
       body=hostile_bodies(),
       content_type=st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=zz", "application/json; charset=latin-1",
                                     "application/octet-stream"]))
def test_hostile_bodies_paths_and_content_types(client, path, method, body, content_type):
    status, ctype, data = client.request(method, path, body, content_type)
    if path in ("/v1/models", "/health") and method == "GET":
        assert status == 200
        return
    check(status, ctype, data)


def test_server_survived_the_fuzzing(server, client):
    assert SENT["count"] >= 500
    status, _, data = client.request("GET", "/health", None, None)
    assert status == 200 and json.loads(data) == {"status": "ok"}
    assert server.call(lambda: harness.num_live_requests(server.engine)) == 0
    body = b'{"prompt": "still here", "max_tokens": 3, "ignore_eos": true}'
    status, _, data = client.request("POST", "/v1/completions", body, "application/json")
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3
