"""Dtypes and devices: bfloat16 stays within bfloat16 error; on CUDA the parity suite holds.

On the GPU machine: ``pytest -m gpu tests/engine/test_v4_device.py`` runs, for each of the four
parity configs of test_v4_parity.py, our runner on CUDA in float32 against transformers in
float32 (on the CPU, the most exact oracle): prompt logprobs within 1e-4, 64 greedy tokens equal
to ``generate``, 8 prompts in one batch and odd prefill chunks equal to one-shot runs (tokens;
logits within 1e-4, as CUDA float32 is not batch-invariant by default), then a bfloat16 run on
CUDA within bfloat16 error. TF32 is off for the float32 runs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.moe import MoE, RoutePlan
from deepinfer.engine.models.deepseek_v4.testing import (
    CSA,
    HCA,
    PARITY_CONFIGS,
    PARITY_PROMPT_LENGTHS,
    SLIDING,
    SeqDriver,
    hf_prompt_logprobs,
    hf_reference,
)

LAYERS = dict(layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)
BLOCK_SIZE = 16


def needs_cuda(test):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(scope="module")
def case():
    ref = hf_reference(seed=1, **LAYERS)
    prompt = torch.randint(0, ref.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    return ref, prompt


def new_driver(ref, max_len, num_seqs=1, device="cpu", dtype=torch.float32) -> SeqDriver:
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=num_seqs * blocks_per_seq, num_slots=num_seqs,
                         block_size=BLOCK_SIZE, device=device, dtype=dtype)  # fmt: skip
    return SeqDriver(runner, blocks_per_seq)


def run(ref, prompt, device="cpu", dtype=torch.float32, num_new=16, chunk=33):
    driver = new_driver(ref, len(prompt) + num_new, device=device, dtype=dtype)
    driver.add(0, prompt)
    logits = driver.prefill([0], chunk=chunk)[0]
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


def test_device_side_moe_plan_equals_the_host_plan():
    """The sync-free dense dispatch used off the CPU gives the same expert outputs."""
    ref = hf_reference(seed=3, layer_types=[SLIDING, SLIDING], n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(ref.config, 1)
    prefix = "layers.1.mlp."
    moe.load_state_dict({k.removeprefix(prefix): v for k, v in ref.state_dict.items() if k.startswith(prefix)})
    moe.finalize()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, ref.config.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4].sort().values for _ in range(8)])
    plan = RoutePlan(ids, torch.rand(8, 4, generator=gen))
    outs = []
    for dispatch in (moe._dispatch_on_device(plan, False), moe.dispatch(plan, False)):
        outs.append(moe.combine(torch.zeros_like(x), moe.compute(x, dispatch, False), dispatch, plan))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


# ---- CUDA --------------------------------------------------------------------------------------


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=list(PARITY_CONFIGS))
def parity_case(request):
    name = request.param
    ref = hf_reference(seed=len(name), **PARITY_CONFIGS[name])  # the seeds of test_v4_parity.py
    ref.hf_model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ref.config.vocab_size, (PARITY_PROMPT_LENGTHS[name],), generator=g).tolist()
    return name, ref, prompt


@needs_cuda
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.timeout(600)
def test_cuda_float32_parity(parity_case):
    name, ref, prompt = parity_case
    theirs = hf_prompt_logprobs(ref.hf_model, prompt)
    driver = new_driver(ref, len(prompt) + 64, device="cuda")
    driver.add(0, prompt)
    logits = driver.prefill([0])[0].cpu()
    ours = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logprob diff| on CUDA {diff:.2e}"

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                    pad_token_id=0)  # fmt: skip
    tokens, _ = driver.greedy([0], 64, {0: logits[-1:].to("cuda")})
    assert tokens[0] == out[0, len(prompt) :].tolist(), f"{name}: greedy tokens differ on CUDA"


@needs_cuda
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.timeout(600)
def test_cuda_batch_and_chunks_match_one_shot(parity_case):
    name, ref, prompt = parity_case
    lengths = [5, 17, 40, 64, 101, 150, 203, len(prompt)]
    prompts = [prompt[:n] for n in lengths[:-1]] + [prompt]
    num_new = 8

    def generate(seqs: list[list[int]], chunk=None):
        driver = new_driver(ref, max(map(len, seqs)) + num_new, num_seqs=len(seqs), device="cuda")
        for i, p in enumerate(seqs):
            driver.add(i, p)
        ids = list(range(len(seqs)))
        first = driver.prefill(ids, chunk=chunk)
        tokens, rows = driver.greedy(ids, num_new, first)
        return [tokens[i] for i in ids], [torch.cat([first[i].cpu(), rows[i][1:].cpu()]) for i in ids]

    together, together_rows = generate(prompts)
    for i, p in enumerate(prompts):
        alone, alone_rows = generate([p])
        assert alone[0] == together[i], f"{name}: prompt {i} tokens differ in a batch on CUDA"
        assert torch.allclose(alone_rows[0], together_rows[i], atol=1e-4, rtol=0)
    for chunk in (7, 33, 100):
        chunked, chunked_rows = generate([prompt], chunk=chunk)
        assert chunked[0] == together[-1], f"{name}: chunk {chunk} tokens differ on CUDA"
        assert torch.allclose(chunked_rows[0], together_rows[-1], atol=1e-4, rtol=0)


@needs_cuda
def test_cuda_bfloat16_stays_within_bfloat16_error(case, no_tf32):
    ref, prompt = case
    expected = hf_logprobs(ref.hf_model, prompt)
    bf16, _ = run(ref, prompt, device="cuda", dtype=torch.bfloat16)
    hf16 = hf_reference(seed=1, **LAYERS).hf_model.to("cuda", torch.bfloat16)
    their_err = (hf_logprobs(hf16, prompt) - expected).abs().mean()
    assert torch.isfinite(bf16).all()
    our_err = (bf16 - expected).abs().mean()
    assert our_err <= 1.5 * their_err, f"CUDA bf16 mean |dlogprob| {our_err:.3f} vs transformers' {their_err:.3f}"
