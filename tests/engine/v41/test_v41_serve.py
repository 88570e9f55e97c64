"""``deepinfer serve`` on a V4.1 checkpoint: the OpenAI completions of the co-located server and of
``--disaggregated`` (a prefill and a decode process, KV handed off between them) equal the
offline LLM's tokens; an unreadable image in a chat message is a clear 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.transport.ports import free_tcp_port
from tests.conftest import load_test_helper

gateway = load_test_helper("runtime/gateway_process")

FLAGS = ["--dtype", "float32", "--block-size", "16", "--num-blocks", "96", "--max-model-len", "1024",
         "--num-threads", "1"]


def _post(url, path, body):
    req = urllib.request.Request(url + path, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(600)
def test_serve_and_disaggregated_serve_equal_offline(tiny_dir, tmp_path):
    prompts = [[(31 * i + 7 * k) % 470 + 5 for k in range(20 + 37 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_dir), dtype="float32", device="cpu", max_model_len=1024, block_size=16)
    want = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].text for p in prompts]
    llm.shutdown()
    assert all(want)  # real text to compare
    env = gateway.serve_env(tmp_path / "cache")
    for extra in ([], ["--disaggregated", "--prefill", "1", "--decode", "1"]):
        with gateway.Served(["--model", str(tiny_dir), *FLAGS, *extra], env, free_tcp_port()) as served:
            for prompt, text in zip(prompts, want):
                status, body = _post(served.url, "/v1/completions", {
                    "model": tiny_dir.name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True})
                assert status == 200, body
                assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == 8, extra
            if not extra:
                status, body = _post(served.url, "/v1/chat/completions", {
                    "model": tiny_dir.name, "max_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
                assert status == 400 and "is not a readable image" in body["error"]["message"]
