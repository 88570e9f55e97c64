"""X-Request-Id: echoed or generated on every response, and leading the engine's request ids (so
the engine's log lines name it); unknown request fields are logged once, at debug level."""

import json
import logging

import aiohttp
import pytest

from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")


@pytest.fixture
async def gw():
    engine = harness.fake_engine()
    async with harness.running_gateway(engine) as gateway:
        async with aiohttp.ClientSession(gateway.url) as session:
            yield session, engine


CHAT = {"model": "fake-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_the_client_id_leads_the_engine_ids_and_comes_back(gw):
    session, engine = gw
    async with session.post("/v1/chat/completions", json={**CHAT, "n": 2},
                            headers={"X-Request-Id": "job-17.a"}) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "job-17.a"
        body = await resp.json()
    ids = sorted(r.request_id for r in engine.requests)
    assert ids == [f"job-17.a.{body['id']}-0", f"job-17.a.{body['id']}-1"]
    async with session.post("/v1/completions", json={"model": "fake-tiny", "prompt": "x", "max_tokens": 2,
                                                     "stream": True}) as resp:
        generated = resp.headers["X-Request-Id"]
        await resp.read()
    assert len(generated) == 32 and engine.requests[-1].request_id.startswith(generated + ".cmpl-")


@pytest.mark.parametrize("sent", ["", "x" * 129, "a b", "new\\nline", "ünïcode"])
async def test_unusable_ids_are_replaced(gw, sent):
    session, _ = gw
    async with session.get("/v1/models", headers={"X-Request-Id": sent}) as resp:
        got = resp.headers["X-Request-Id"]
    assert got != sent and len(got) == 32


async def test_errors_and_unknown_routes_carry_one_too(gw):
    session, _ = gw
    for method, path, body in (("POST", "/v1/chat/completions", b"{nope"), ("GET", "/v2/nothing", None),
                               ("POST", "/v1/responses", json.dumps({"input": "x", "previous_response_id": "r"}))):
        async with session.request(method, path, data=body, headers={"X-Request-Id": "e-1"}) as resp:
            assert resp.status >= 400 and resp.headers["X-Request-Id"] == "e-1"


async def test_an_unknown_field_is_ignored_and_logged_once(gw, caplog):
    session, _ = gw
    caplog.set_level(logging.DEBUG, logger="deepinfer.runtime.gateway.openai_protocol")
    for _ in range(3):
        async with session.post("/v1/chat/completions", json={**CHAT, "frobnicate_level_9": 3}) as resp:
            assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if "frobnicate_level_9" in r.getMessage()]
    assert len(lines) == 1 and "ChatCompletionRequest" in lines[0]
