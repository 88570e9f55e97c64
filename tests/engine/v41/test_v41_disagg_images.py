"""Images through a disaggregated cluster on the tiny V4.1 checkpoint (float32 CPU): ``LocalPdCluster``
with one prefill, one decode and two encoder node processes (what ``serve --disaggregated
--encoders 2`` starts). The gateway's client prepares the images, the encoders encode them and
push the embeddings to the prefill engine on the data plane, the KV goes on to the decode engine
with the image spans: each answer equals the co-located engine's token for token, and an encoder
killed mid-run costs no request. A chat with an image data URL through the gateway on that cluster
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


def prompts(tokenizer):
    out = []
    for r in range(8):
        images = [picture(10 * r + k) for k in range(1 + r % 3)]
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
        cluster = LocalPdCluster(tiny_dir, num_prefill=1, num_decode=1, num_encoders=2, engine_options=ENGINE,
                                 request_timeout_s=120)
        await cluster.start(ready_timeout_s=200)
        try:
            first = await asyncio.gather(*(_generate(cluster.client, f"a{r}", p, params) for r, p in enumerate(reqs)))
            pool = cluster.client.encoders
            used = {name: n for name, n in pool.images_by_encoder().items()}

            async def kill_when_busy():
                while not any(e.pending_tokens for e in pool._encoders if e.ref.name == "encoder-0"):
                    await asyncio.sleep(0.002)
                await cluster.supervisor.kill("encoder-0")

            killer = asyncio.ensure_future(kill_when_busy())
            second = await asyncio.gather(*(_generate(cluster.client, f"b{r}", p, params) for r, p in enumerate(reqs)))
            await asyncio.wait_for(killer, 5)
            for _ in range(50):  # the pool's probes see the kill within a second
                if "encoder-0" not in pool.up:
                    break
                await asyncio.sleep(0.1)
            chat = await _stream_chat(cluster.client, params)
            return first, second, used, pool.num_reencoded, pool.up, chat
        finally:
            await cluster.close()

    first, second, used, num_reencoded, up, chat = asyncio.run(main())
    assert first == want and second == want
    assert chat == want_chat and want_chat
    assert up == ["encoder-1"]
    assert all(n > 0 for n in used.values()), used  # both encoders took images
    print(f"\nimages per encoder (first round) {used}; re-encoded after the kill: {num_reencoded}")
