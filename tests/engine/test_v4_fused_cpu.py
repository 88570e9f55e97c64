"""The one-call CPU paths (attention inputs and outputs, mHC update + weights + norm, whole MoE block, window
pool and ring writes) give bitwise the numbers of the staged ops they replace, through prefill
and decode."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import PARITY_CONFIGS, SeqDriver, hf_reference
from deepinfer.kernels import cpu_gemm, cpu_native

pytestmark = pytest.mark.skipif(not cpu_gemm.usable(torch.ones(1)), reason="no native AVX2 GEMM here")

FUSED = ("attention_inputs", "attention_outputs", "hc_post_pre", "moe_forward")


def _run(ref, prompts) -> list[torch.Tensor]:
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=4 * len(prompts), num_slots=len(prompts), block_size=64)
    driver = SeqDriver(runner, 4)
    ids = list(range(len(prompts)))
    for i, p in enumerate(prompts):
        driver.add(i, p)
    first = driver.prefill(ids, chunk=50)
    _, rows = driver.greedy(ids, 6, first)
    return [torch.cat([first[i], rows[i]]) for i in ids]


@pytest.mark.parametrize("name", ["mixed_hc2", "hc4_yarn_2hash"])
def test_fused_cpu_calls_match_the_staged_native_ops(name, monkeypatch):
    ref = hf_reference(seed=1, **PARITY_CONFIGS[name])
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=gen).tolist() for n in (70, 33)]
    fused = _run(ref, prompts)
    for fn in FUSED:
        monkeypatch.setattr(cpu_gemm, fn, lambda *a, **k: None)
    monkeypatch.setattr(cpu_native, "window_pool", lambda *a: None)
    monkeypatch.setattr(cpu_native, "window_attention", lambda *a: None)
    monkeypatch.setattr(cpu_native, "ring_write", lambda *a: False)
    staged = _run(ref, prompts)
    for a, b in zip(fused, staged):
        assert torch.equal(a, b)
