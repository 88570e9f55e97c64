"""Images through a disaggregated cluster on the tiny V4.1 checkpoint (float32 CPU): ``LocalPdCluster``
with one prefill, one decode and three encoder node processes (what ``serve --disaggregated
--encoders 3`` starts). The gateway's client prepares the images, the encoders encode them and
push the embeddings to the prefill engine on the data plane, the KV goes on to the decode engine
with the image spans: 32 requests of 1-4 images each, one encoder killed mid-run, every answer
equals the co-located engine's token for token. A chat with an image data URL through the gateway on that cluster
streams the co-located answer (the official ``openai`` client)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.runtime.disagg.launch import LocalPdCluster
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")

IMAGE = "<｜deepseek_image｜>"
ENGINE = dict(dtype="float32", num_threads=1, block_size=16, num_blocks=256, max_model_len=1024, max_num_seqs=8)
pytestmark = pytest.mark.timeout(300)


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = (int(x) for x in rng.integers(40, 200, 2))
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


NUM_REQUESTS = 32


def prompts(tokenizer):
    out = []
    for r in range(NUM_REQUESTS):
        images = [picture(10 * r + k) for k in range(1 + r % 4)]
        text = f"Request {r}: " + " and ".join(IMAGE for _ in images) + " differ how?"
        out.append({"prompt_token_ids": tokenizer.encode(text), "multi_modal_data": {"image": images}})
    return out


async def _generate(client, rid, prompt, params):
    acc = None
    async for out in client.generate(prompt, params, request_id=rid):
        acc = merge_output(acc, out)
    assert acc is not None and acc.finished
    return acc.outputs[0].token_ids


async def _stream_chat(engine, params) -> str:
    buf = io.BytesIO()
    picture(99).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    async with harness.running_gateway(engine) as gateway:
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            stream = await client.chat.completions.create(
                model=engine.model_info.name, max_tokens=params.max_tokens, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}]}])
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        finally:
            await client.close()


def test_disaggregated_images_equal_co_located(tiny_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_dir), device="cpu", **ENGINE)
    try:
        reqs = prompts(llm.tokenizer)
        want = [o.outputs[0].token_ids for o in llm.generate(reqs, params)]
        chat_text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Look: {IMAGE}"}],
                                                      add_generation_prompt=True, tokenize=False)
        chat_ids = llm.tokenizer.encode(chat_text, add_special_tokens=False)
        want_chat = llm.generate({"prompt_token_ids": chat_ids, "multi_modal_data": {"image": picture(99)}},
                                 params)[0].outputs[0].text
    finally:
        llm.shutdown()

    async def main():
        cluster = LocalPdCluster(tiny_dir, num_prefill=1, num_decode=1, num_encoders=3, engine_options=ENGINE,
                                 request_timeout_s=120)
        await cluster.start(ready_timeout_s=200)
        try:
            pool = cluster.client.encoders
            pool.placements = []

            started = []

            # a quarter of the requests sent, while it encodes (by the time a quarter have
            # *finished* on a loaded machine every image may be encoded: nothing to kill it under)
            async def kill_when_busy():
                while len(started) < NUM_REQUESTS // 4 or not any(
                        e.pending_tokens for e in pool._encoders if e.ref.name == "encoder-0"):
                    await asyncio.sleep(0.001)
                await cluster.supervisor.kill("encoder-0")

            async def staggered(r, prompt):
                await asyncio.sleep(0.03 * r)  # arrivals over ~1 s
                started.append(r)
                return await _generate(cluster.client, f"r{r}", prompt, params)

            killer = asyncio.ensure_future(kill_when_busy())
            got = await asyncio.gather(*(staggered(r, p) for r, p in enumerate(reqs)))
            await asyncio.wait_for(killer, 5)
            for _ in range(50):  # the pool's probes see the kill within a second
                if "encoder-0" not in pool.up:
                    break
                await asyncio.sleep(0.1)
            chat = await _stream_chat(cluster.client, params)
            return got, pool.images_by_encoder(), pool.num_reencoded, pool.up, chat, pool.placements
        finally:
            await cluster.close()

    got, by_encoder, num_reencoded, up, chat, placements = asyncio.run(main())
    assert got == want  # every request completed, token for token the co-located answer
    assert up == ["encoder-1", "encoder-2"]  # the killed one was seen down
    assert any(p.encoder == "encoder-0" for p in placements)  # it had work when it was killed
    # no image lost: every one encoded once by a survivor or before the kill (+ the chat's one)
    assert sum(by_encoder.values()) == sum(len(p["multi_modal_data"]["image"]) for p in reqs) + 1
    assert all(p.pending_before[p.encoder] == min(p.pending_before.values()) for p in placements)
    assert chat == want_chat and want_chat
    print(f"\nimages per encoder {by_encoder}; re-encoded after the kill: {num_reencoded}")
