"""The fused Gumbel-max kernel (kernels/gpu_sampling.py) against the sampler's torch form, on the
GPU machine (gpu marker; skipped without CUDA): the same token in every row, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.counter_rng import GumbelNoise
from deepinfer.engine.sample.sampler import Sampler
from deepinfer.engine.sample.metadata import SampleRow, SamplingMetadata
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.kernels import gpu_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def _torch_form(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    noise = GumbelNoise().gumbel(keys, logits.shape[1])
    return ((logits / temperature.unsqueeze(1)) + noise).argmax(dim=-1)


def _draw(logits, temperature, keys):
    noise = GumbelNoise()
    return gpu_sampling.gumbel_argmax(logits, temperature, keys, noise.token_hash32(logits.shape[1], logits.device))


@pytest.mark.parametrize("rows,vocab", [(1, 4096), (7, 1000), (256, 4096), (33, 129_280), (3, 2049)])
def test_fused_draw_equals_the_torch_form(rows, vocab):
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + vocab)
    for trial in range(3):
        logits = torch.randn(rows, vocab, device="cuda", generator=g) * (0.5 + 3 * trial)
        temperature = torch.rand(rows, device="cuda", generator=g) * 1.4 + 0.1
        keys = torch.randint(0, 1 << 32, (rows,), device="cuda", dtype=torch.int64, generator=g)
        assert gpu_sampling.available(logits)
        got = _draw(logits, temperature, keys)
        assert got.dtype == torch.int64 and torch.equal(got, _torch_form(logits, temperature, keys))


def test_masked_rows_strided_rows_and_nan():
    g = torch.Generator(device="cuda").manual_seed(3)
    big = torch.randn(64, 5000, device="cuda", generator=g)
    logits = big[::2, :4097]  # row stride 10000, not contiguous as a whole
    logits[0, :] = float("-inf")  # nothing allowed: torch.argmax picks 0
    logits[1, :4000] = float("-inf")  # only a tail block allowed
    logits[2, 123] = float("nan")
    logits[2, 3000] = float("nan")
    temperature = torch.full((32,), 0.7, device="cuda")
    keys = torch.arange(32, device="cuda", dtype=torch.int64) * 2654435761 % (1 << 32)
    got = _draw(logits, temperature, keys)
    assert got[0].item() == 0 and 4000 <= got[1].item() < 4097 and got[2].item() == 123
    want = _torch_form(logits.contiguous(), temperature, keys)
    assert torch.equal(got[3:], want[3:]) and got[1].item() == want[1].item()


def test_sampler_on_cuda_equals_sampler_on_cpu():
    """Temperature-only rows take the fused kernel; top-p rows its T = 1 form after masking;
    greedy rows argmax: the same tokens as the CPU sampler (CPU noise is drawn by numpy)."""
    g = torch.Generator().manual_seed(11)
    vocab, rows = 4096, []
    for i in range(48):
        kind = i % 3
        params = SamplingParams(temperature=0.0 if kind == 0 else 0.9, top_p=0.8 if kind == 2 else 1.0, seed=i)
        rows.append(SampleRow(params=params, seed=i, position=17 + i, output_token_ids=[], prompt_token_ids=[1, 2]))
    logits = torch.randn(len(rows), vocab, generator=g) * 4
    cpu = Sampler()(logits, SamplingMetadata.build(rows, vocab, "cpu")).token_ids
    gpu = Sampler()(logits.cuda(), SamplingMetadata.build(rows, vocab, "cuda")).token_ids.cpu()
    assert torch.equal(cpu, gpu)
    keep = [i for i, r in enumerate(rows) if r.params.temperature > 0 and r.params.top_p == 1.0]
    only_sampled, sub = [rows[i] for i in keep], logits[keep]
    cpu = Sampler()(sub, SamplingMetadata.build(only_sampled, vocab, "cpu")).token_ids
    gpu = Sampler()(sub.cuda(), SamplingMetadata.build(only_sampled, vocab, "cuda")).token_ids.cpu()
    assert torch.equal(cpu, gpu)
