"""The whole engine on CUDA (gpu marker; skipped without a CUDA device): AsyncEngine with the
pipelined step loop, sampler, grammar bitmasks and logprobs on the device, against the same engine
on the CPU with the same tiny checkpoint.

On the GPU machine: ``pytest -m gpu tests/engine/test_engine_cuda.py``.

Greedy and seeded (temperature 0.8) tokens must equal the CPU engine's: sampling draws from
counter-based noise keyed by (seed, position), so a device change may only alter a token where
float32 logits of the two devices differ across a decision boundary, which a random tiny model
with logit gaps of ~1e-2 does not produce at ~1e-6 error. Logprobs agree within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest
import torch

from deepinfer import AsyncEngine, SamplingParams
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.text.output_processor import merge_output

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(240),
]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}"


def _requests() -> list[tuple[str, dict, SamplingParams]]:
    reqs = []
    for i in range(6):
        prompt = {"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(10 + 9 * i)]}
        reqs.append((f"g{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)))
        reqs.append((f"s{i}", prompt, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=100 + i,
                                                     ignore_eos=True)))
    for i in range(3):
        reqs.append((f"j{i}", f"record {i}:", SamplingParams(max_tokens=96, temperature=0.0,
                                                             structured_outputs={"json": SCHEMA})))
        reqs.append((f"r{i}", f"answer {i}:", SamplingParams(max_tokens=32, temperature=0.7, seed=i,
                                                             structured_outputs={"regex": REGEX})))
    return reqs


async def _run_all(device: str, model_dir) -> dict:
    engine = await AsyncEngine.start(model=str(model_dir), dtype="float32", device=device, max_model_len=512,
                                     max_num_seqs=8, block_size=128, json_any_whitespace=False,
                                     check_integrity_every_step=True)
    try:
        async def one(rid, prompt, params):
            acc = None
            async for out in engine.generate(prompt, params, request_id=rid):
                acc = merge_output(acc, out)
            return rid, acc.outputs[0]

        done = await asyncio.gather(*(one(*r) for r in _requests()))
        return dict(done)
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_cuda_engine")
    write_tiny_model(path, seed=5, layers="WCHC")
    return path


@pytest.fixture(scope="module")
def results(model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return asyncio.run(_run_all("cpu", model_dir)), asyncio.run(_run_all("cuda", model_dir))


def test_cuda_engine_tokens_equal_cpu_engine(results):
    cpu, cuda = results
    assert set(cpu) == set(cuda)
    for rid in sorted(cpu):
        if rid[0] in "gs":
            assert cuda[rid].token_ids == cpu[rid].token_ids, rid
            assert cuda[rid].finish_reason == "length"


def test_cuda_logprobs_match_cpu(results):
    cpu, cuda = results
    for rid in (r for r in cpu if r.startswith("g")):
        assert len(cuda[rid].logprobs) == len(cpu[rid].token_ids)
        for pos_cpu, pos_cuda in zip(cpu[rid].logprobs, cuda[rid].logprobs):
            assert set(pos_cpu) == set(pos_cuda)
            for tok, lp in pos_cpu.items():
                assert math.isclose(pos_cuda[tok].logprob, lp.logprob, abs_tol=1e-4), (rid, tok)


def test_cuda_structured_outputs_are_valid(results):
    _, cuda = results
    for rid, out in cuda.items():
        if rid.startswith("j"):
            assert out.finish_reason == "stop", (rid, out.text)
            value = json.loads(out.text)
            assert set(value) == {"name", "n", "tags"} and 0 <= value["n"] <= 99, value
            assert isinstance(value["name"], str) and all(t in ("a", "b") for t in value["tags"])
        elif rid.startswith("r"):
            assert re.fullmatch(REGEX, out.text), (rid, out.text)
