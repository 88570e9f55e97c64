"""The README's embedding story, run as written: a user's own aiohttp app starts ``AsyncEngine``
inside its own event loop, streams from it in its own handler, and can mount the
OpenAI-compatible gateway next to its routes. Nothing owns the loop but the user's app."""

import asyncio
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from deepinfer import AsyncEngine, SamplingParams
from deepinfer.engine.api.async_engine import EngineDeadError
from deepinfer.runtime.gateway import GatewayConfig, build_app
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
MODEL_DIR = str(harness.tiny_model_dir())  # any HF-style model directory

# ---- the user's application (what the README shows) ------------------------------------------
ENGINE = web.AppKey("engine", AsyncEngine)


async def engine_lifetime(app: web.Application):
    app[ENGINE] = await AsyncEngine.start(model=MODEL_DIR, max_num_seqs=8, max_model_len=1024)
    yield
    await app[ENGINE].shutdown()  # aborts what is left, joins the device thread


async def story(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    params = SamplingParams(max_tokens=body.get("max_tokens", 32), temperature=0.8, seed=body.get("seed"))
    resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await resp.prepare(request)
    # leaving this loop early (client gone -> handler cancelled) aborts the engine request
    async for out in request.app[ENGINE].generate(body["prompt"], params):
        await resp.write(out.outputs[0].text.encode())
    await resp.write_eof()
    return resp


def make_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(engine_lifetime)
    app.router.add_post("/story", story)
    return app

# ----------------------------------------------------------------------------------------------


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_user_app_streams_from_an_engine_in_its_own_loop():
    runner, url = await _serve(make_app())
    try:
        engine = runner.app[ENGINE]
        async with aiohttp.ClientSession(url) as session:
            async def read(seed):
                pieces = []
                async with session.post("/story", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                        "seed": seed}) as resp:
                    assert resp.status == 200
                    async for chunk in resp.content.iter_any():
                        pieces.append(chunk.decode())
                return pieces

            a, b, c = await asyncio.gather(read(1), read(1), read(2))  # batched together
        assert "".join(a) == "".join(b) != "".join(c)  # seeded, independent of the batch
        assert len(a) > 1  # streamed in pieces, not one body at the end
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
    finally:
        await runner.cleanup()  # runs engine_lifetime's shutdown
    with pytest.raises(EngineDeadError):  # the app's cleanup shut the engine down
        await engine.check_health()


async def test_user_app_mounts_the_openai_gateway_next_to_its_routes():
    engine = await AsyncEngine.start(model=MODEL_DIR, max_num_seqs=4, max_model_len=1024,
                                     served_model_name="mine")
    app = web.Application()
    app[ENGINE] = engine
    app.router.add_post("/story", story)
    app.add_subapp("/openai", build_app(engine, GatewayConfig(api_key="k")))  # /openai/v1/..., /openai/health
    runner, url = await _serve(app)
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/openai/v1", api_key="k", max_retries=0)
        chat = await client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6
        await client.close()
        async with aiohttp.ClientSession(url) as session:
            async with session.get("/openai/health") as resp:  # open without the key, also under a prefix
                assert json.loads(await resp.text()) == {"status": "ok"}
            async with session.get("/openai/v1/models") as resp:
                assert resp.status == 401
            async with session.post("/story", json={"prompt": "x", "max_tokens": 3}) as resp:
                assert resp.status == 200 and await resp.text()
    finally:
        await runner.cleanup()
        await engine.shutdown()
