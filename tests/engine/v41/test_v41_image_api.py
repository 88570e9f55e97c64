"""Images through the APIs on the tiny V4.1 checkpoint (float32 CPU): ``LLM.generate`` with
``multi_modal_data``, and the real gateway with the official ``openai`` client (a chat with an
image data URL streams the answer the offline engine gives; a malformed image, an oversized one
and a URL when URLs are off are each a 400 with a clear message)."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import pytest_asyncio
from PIL import Image

from deepinfer import LLM, AsyncEngine, SamplingParams
from deepinfer.engine.api.llm import LLMError
from deepinfer.runtime.gateway.config import GatewayConfig
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
pytestmark = [pytest.mark.timeout(120)]
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16, max_num_seqs=4, num_threads=1)
IMAGE = "<｜deepseek_image｜>"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MAX_IMAGE_BYTES = 100_000


def picture(seed: int, size=(150, 110)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "?"}]}]


@pytest.fixture(scope="module")
def offline(tiny_dir):
    """The offline answers the server must reproduce: (chat prompt text, image) -> token ids."""
    llm = LLM(model=str(tiny_dir), **OPTIONS)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_llm_generate_with_multi_modal_data(offline):
    prompt = f"What is in {IMAGE}?"
    a = offline.generate({"prompt": prompt, "multi_modal_data": {"image": picture(1)}}, GREEDY)[0]
    again = offline.generate({"prompt": prompt, "multi_modal_data": {"image": [picture(1)]}}, GREEDY)[0]
    b = offline.generate({"prompt": prompt, "multi_modal_data": {"image": picture(2)}}, GREEDY)[0]
    text = offline.generate({"prompt": "What is in ?"}, GREEDY)[0]
    num_text = len(text.prompt_token_ids)
    assert len(a.prompt_token_ids) == num_text + 17  # 150x110 -> 8x11 patches -> 3x4 cells: 3 * 5 + 2
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert again.num_cached_tokens == len(a.prompt_token_ids) // 16 * 16 > 0  # the same image: a prefix hit
    assert b.outputs[0].token_ids != a.outputs[0].token_ids and b.num_cached_tokens == 0
    assert text.outputs[0].token_ids != a.outputs[0].token_ids
    with pytest.raises(LLMError, match=r"prompt 0: the prompt has 0 image placeholder\(s\) .* for 1 image"):
        offline.generate({"prompt": "no placeholder", "multi_modal_data": {"image": picture(1)}}, GREEDY)
    with pytest.raises(LLMError, match="multi_modal_data has 'video'"):
        offline.generate({"prompt": prompt, "multi_modal_data": {"video": picture(1)}}, GREEDY)


@pytest_asyncio.fixture
async def served(tiny_dir):
    engine = await AsyncEngine.start(model=str(tiny_dir), served_model_name="tiny", **OPTIONS)
    try:
        async with harness.running_gateway(engine, GatewayConfig(max_image_bytes=MAX_IMAGE_BYTES)) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                yield client
            finally:
                await client.close()
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_chat_with_an_image_data_url_streams_the_offline_answer(served, offline):
    client = served
    image = picture(3)
    tok = offline.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": f"What is in {IMAGE}?"}],
                                       add_generation_prompt=True, tokenize=False)
    want = offline.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False),
                             "multi_modal_data": {"image": image}}, GREEDY)[0].outputs[0].text
    assert want
    stream = await client.chat.completions.create(model="tiny", messages=chat_messages(data_url(image)),
                                                  max_tokens=8, temperature=0.0, stream=True,
                                                  extra_body={"ignore_eos": True},
                                                  stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 17
    # the same text through another picture (JPEG this time) answers differently
    other = await client.chat.completions.create(model="tiny", messages=chat_messages(data_url(picture(4), "JPEG")),
                                                 max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert other.choices[0].message.content != want


@pytest.mark.asyncio
@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,AAAA", "messages[0].content[1].image_url is not a readable image"),
    ("data:image/png;base64,@@not base64@@", "holds invalid base64 data"),
    ("data:text/plain,hello", "is not a base64 image data URL"),
    ("https://example.com/cat.png", "image URLs are off on this server; send the image inline as a data URL"),
    ("big", f"the image is over the server's {MAX_IMAGE_BYTES}-byte limit per image"),
])
async def test_bad_images_are_400s_with_a_clear_message(served, url, message):
    if url == "big":
        url = data_url(picture(5, (300, 300)))  # ~270 kB of PNG noise
    with pytest.raises(openai.BadRequestError) as err:
        await served.chat.completions.create(model="tiny", messages=chat_messages(url), max_tokens=2)
    assert err.value.status_code == 400
    body = err.value.body
    assert message in body["message"] and "\n" not in body["message"]
    assert body["param"] == "messages[0].content[1].image_url"


@pytest_asyncio.fixture
async def served_with_urls(tiny_dir):
    from aiohttp import web

    small, big = io.BytesIO(), io.BytesIO()
    picture(3).save(small, format="PNG")
    picture(5, (300, 300)).save(big, format="PNG")
    files = {"/cat.png": small.getvalue(), "/big.png": big.getvalue()}

    async def handle(request):
        body = files.get(request.path)
        return web.Response(body=body, content_type="image/png") if body else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    engine = await AsyncEngine.start(model=str(tiny_dir), served_model_name="tiny", **OPTIONS)
    config = GatewayConfig(max_image_bytes=MAX_IMAGE_BYTES, allow_image_urls=True)
    try:
        async with harness.running_gateway(engine, config) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                yield client, base
            finally:
                await client.close()
    finally:
        await engine.shutdown()
        await runner.cleanup()


@pytest.mark.asyncio
async def test_http_image_urls_when_enabled(served_with_urls):
    client, base = served_with_urls
    kw = dict(model="tiny", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    by_url = await client.chat.completions.create(messages=chat_messages(f"{base}/cat.png"), **kw)
    inline = await client.chat.completions.create(messages=chat_messages(data_url(picture(3))), **kw)
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    for path, message in [("/big.png", f"over the server's {MAX_IMAGE_BYTES}-byte limit"),
                          ("/missing.png", "fetching the image gave HTTP 404")]:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(messages=chat_messages(base + path), **kw)
        assert message in err.value.body["message"]


def test_serve_image_flags(tiny_dir, capsys):
    """``serve --allow-image-urls --max-image-bytes N`` set the gateway's image settings; a bad
    size is a one-line usage error before anything loads."""
    import argparse

    from deepinfer.bin import serve
    from deepinfer.bin.cli import main

    p = argparse.ArgumentParser()
    serve.add_image_arguments(p)
    assert serve.image_settings(p.parse_args(["--allow-image-urls", "--max-image-bytes", "5000"])) == {
        "allow_image_urls": True, "max_image_bytes": 5000}
    assert serve.image_settings(p.parse_args([])) == {}
    assert main(["serve", "--model", str(tiny_dir), "--max-image-bytes", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-image-bytes must be >= 1" in err and "\n" not in err
