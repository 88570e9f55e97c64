"""Dtypes and devices: bfloat16 stays within bfloat16 error; CUDA matches transformers (gpu marker).

On the GPU machine: ``pytest -m gpu tests/engine/test_v4_device.py``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, SeqDriver, hf_reference

LAYERS = dict(layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)


@pytest.fixture(scope="module")
def case():
    ref = hf_reference(seed=1, **LAYERS)
    prompt = torch.randint(0, ref.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    return ref, prompt


def run(ref, prompt, device="cpu", dtype=torch.float32, num_new=16):
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=40, num_slots=2, block_size=16, device=device, dtype=dtype)
    driver = SeqDriver(runner, 20)
    driver.add(0, prompt)
    logits = driver.prefill([0], chunk=33)[0]
    tokens, _ = driver.greedy([0], num_new, {0: logits})
    return torch.log_softmax(logits.float().cpu(), -1), tokens[0]


def hf_logprobs(model, prompt):
    device = next(model.parameters()).device
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt], device=device)).logits[0].float().cpu(), -1)


def test_bfloat16_error_is_that_of_transformers_in_bfloat16(case):
    ref, prompt = case
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exact, _ = run(ref, prompt)
        ours, _ = run(ref, prompt, dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(previous)
    hf16 = hf_reference(seed=1, **LAYERS).hf_model.to(torch.bfloat16)
    theirs = hf_logprobs(hf16, prompt)
    assert torch.isfinite(ours).all()
    our_err, their_err = (ours - exact).abs().mean(), (theirs - exact).abs().mean()
    assert our_err <= 1.5 * their_err, f"bf16 mean |dlogprob| {our_err:.3f} vs transformers' {their_err:.3f}"
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() > 0.7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_transformers_and_bfloat16_stays_close(case):
    ref, prompt = case
    expected = hf_logprobs(ref.hf_model, prompt)
    ref.hf_model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        greedy = ref.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours, tokens = run(ref, prompt, device="cuda")
    picked = torch.tensor(prompt[1:])[:, None]
    assert (ours[:-1].gather(1, picked) - expected[:-1].gather(1, picked)).abs().max() <= 1e-4
    assert tokens == greedy[0, len(prompt) :].tolist()
    bf16, _ = run(ref, prompt, device="cuda", dtype=torch.bfloat16)
    hf16 = hf_reference(seed=1, **LAYERS).hf_model.to("cuda", torch.bfloat16)
    their_err = (hf_logprobs(hf16, prompt) - expected).abs().mean()
    assert torch.isfinite(bf16).all() and (bf16 - expected).abs().mean() <= 1.5 * their_err
