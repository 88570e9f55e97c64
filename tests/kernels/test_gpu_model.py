"""The whole V4 model on CUDA with the Triton kernels against the same model on the torch ops
(CUDA only): the four tiny parity configs, prompt logits and greedy tokens in float32 (one
sequence, then 5 sequences decoded as one batch), bfloat16 within its own error. Also checks
that building a CUDA model routes the ops to the kernels and that CPU tensors keep their ops."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.models.deepseek_v4.testing import PARITY_CONFIGS, PARITY_PROMPT_LENGTHS, SeqDriver, hf_reference
from deepinfer.kernels import ops
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
if not cases.HAS_CUDA or not cases.RUNNABLE:
    pytest.skip("needs a CUDA device with Triton", allow_module_level=True)
from deepinfer.kernels import gpu_routing  # noqa: E402

try:
    from deepinfer.engine.core.model_runner import ModelRunner
except ImportError:  # before the engine's reorganisation
    from deepinfer.engine.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
BLOCK = 16


def _run(ref, prompts, dtype, kernels: bool, num_new: int):
    max_len = max(len(p) for p in prompts) + num_new
    per_seq = -(-max_len // BLOCK)
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=len(prompts) * per_seq, num_slots=len(prompts),
                         block_size=BLOCK, device="cuda", dtype=dtype)  # fmt: skip
    if not kernels:
        ops.reset()  # finalize routed the CUDA tensors to the kernels: back to the torch ops
    try:
        driver = SeqDriver(runner, per_seq)
        ids = list(range(len(prompts)))
        for i, p in enumerate(prompts):
            driver.add(i, p)
        logits = driver.prefill(ids, chunk=37)
        tokens, _ = driver.greedy(ids, num_new, logits)
    finally:
        ops.reset()
    return {i: lg.float().cpu() for i, lg in logits.items()}, tokens


@pytest.fixture(scope="module", params=list(PARITY_CONFIGS))
def parity(request):
    name = request.param
    ref = hf_reference(seed=len(name), **PARITY_CONFIGS[name])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, ref.config.vocab_size, (PARITY_PROMPT_LENGTHS[name] - 17 * i,), generator=g).tolist()
               for i in range(5)]  # fmt: skip
    return name, ref, prompts


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.usefixtures("no_tf32")
def test_float32_kernels_equal_the_torch_ops(parity):
    name, ref, prompts = parity
    for batch in (prompts[:1], prompts):
        want_logits, want_tokens = _run(ref, batch, torch.float32, kernels=False, num_new=12)
        got_logits, got_tokens = _run(ref, batch, torch.float32, kernels=True, num_new=12)
        for i in want_logits:
            diff = (got_logits[i] - want_logits[i]).abs().max().item()
            assert diff < 1e-4, f"{name}: max |logit diff| {diff:.2e} (sequence {i} of {len(batch)})"
        assert got_tokens == want_tokens, f"{name}: greedy tokens differ (batch of {len(batch)})"


def test_bfloat16_kernels_within_bf16_error(parity):
    name, ref, prompts = parity
    exact, _ = _run(ref, prompts[:2], torch.float32, kernels=False, num_new=1)
    torch_bf16, _ = _run(ref, prompts[:2], torch.bfloat16, kernels=False, num_new=1)
    ours_bf16, _ = _run(ref, prompts[:2], torch.bfloat16, kernels=True, num_new=1)
    for i in exact:
        theirs = (torch_bf16[i] - exact[i]).abs().mean().item()
        ours = (ours_bf16[i] - exact[i]).abs().mean().item()
        assert torch.isfinite(ours_bf16[i]).all() and ours <= 1.5 * theirs + 1e-3, (name, ours, theirs)


def test_cuda_model_routes_cuda_tensors_only():
    ref = hf_reference(seed=0, **PARITY_CONFIGS["mixed_hc2"])
    ModelRunner(ref.config, ref.state_dict, num_blocks=4, num_slots=1, block_size=BLOCK, device="cuda")
    try:
        for name in gpu_routing.KERNELS:
            assert ops.backend_of(name) == gpu_routing.__name__, name
        x = torch.randn(5, 3, 64)
        w = torch.rand(64) + 0.5
        ops_cpu = ops.rms_norm(x, w, 1e-6)
        ops.reset()
        assert torch.equal(ops_cpu, ops.rms_norm(x, w, 1e-6))  # the CPU tensor kept its native kernel
    finally:
        ops.reset()
