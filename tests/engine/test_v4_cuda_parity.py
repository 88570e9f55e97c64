"""The four parity configs of test_v4_parity.py, run by our model on CUDA against transformers on
the CPU in float32 (gpu marker; skipped without a CUDA device).

On the GPU machine: ``pytest -m gpu tests/engine/test_v4_cuda_parity.py``.
The same checks as on the CPU: prompt logprobs within 1e-4, greedy 64 tokens identical, a batch of
prompts of different lengths identical to each alone; plus bfloat16 on CUDA stays within the error
transformers itself makes in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import SeqDriver, hf_prompt_logprobs, hf_reference
from tests.conftest import load_test_helper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


CPU = load_test_helper("engine/test_v4_parity")
BLOCK_SIZE = 16


def cuda_driver(ref, max_len: int, num_seqs: int = 1, dtype=torch.float32) -> SeqDriver:
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=num_seqs * blocks_per_seq, num_slots=num_seqs,
                         block_size=BLOCK_SIZE, device="cuda", dtype=dtype)
    return SeqDriver(runner, blocks_per_seq)


@pytest.fixture(scope="module", params=list(CPU.CONFIGS))
def case(request):
    name = request.param
    ref = hf_reference(seed=len(name), **CPU.CONFIGS[name])
    ref.hf_model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ref.config.vocab_size, (CPU.PROMPT_LENGTHS[name],), generator=g).tolist()
    return name, ref, prompt


def test_cuda_prompt_logprobs_match_transformers(case):
    name, ref, prompt = case
    driver = cuda_driver(ref, len(prompt))
    driver.add(0, prompt)
    logits = driver.prefill([0], chunk=33)[0].float().cpu()
    ours = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    theirs = hf_prompt_logprobs(ref.hf_model, prompt)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logprob diff| on CUDA {diff:.2e}"


def test_cuda_greedy_matches_transformers_generate(case):
    name, ref, prompt = case
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    driver = cuda_driver(ref, len(prompt) + 64)
    driver.add(0, prompt)
    tokens, _ = driver.greedy([0], 64, driver.prefill([0], all_logits=False))
    assert tokens[0] == expected, name


def test_cuda_batch_equals_alone(case):
    name, ref, prompt = case
    lengths = [len(prompt) - 37 * i for i in range(4)]
    prompts = [prompt[:n] for n in lengths]
    alone = []
    for p in prompts:
        d = cuda_driver(ref, len(p) + 8)
        d.add(0, p)
        alone.append(d.greedy([0], 8, d.prefill([0], all_logits=False))[0][0])
    d = cuda_driver(ref, len(prompt) + 8, num_seqs=len(prompts))
    for i, p in enumerate(prompts):
        d.add(i, p)
    batched, _ = d.greedy(list(range(len(prompts))), 8, d.prefill(list(range(len(prompts))), chunk=41, all_logits=False))
    assert [batched[i] for i in range(len(prompts))] == alone, name


def test_cuda_bfloat16_within_transformers_bfloat16_error(case):
    name, ref, prompt = case
    exact = hf_prompt_logprobs(ref.hf_model, prompt)
    driver = cuda_driver(ref, len(prompt), dtype=torch.bfloat16)
    driver.add(0, prompt)
    logits = driver.prefill([0])[0].float().cpu()
    ours = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    hf16 = hf_reference(seed=len(name), **CPU.CONFIGS[name]).hf_model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        hf_logits = hf16(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
    theirs = torch.log_softmax(hf_logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.isfinite(ours).all()
    our_err, their_err = (ours - exact).abs().mean().item(), (theirs - exact).abs().mean().item()
    assert our_err <= 1.5 * their_err + 1e-3, f"{name}: bf16 mean |dlogprob| {our_err:.4f} vs transformers' {their_err:.4f}"
