"""Fixed-order native GEMMs (kernels/cpu_gemm.py): exact enough, and every row stands alone."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import cpu_gemm, cpu_native, torch_ref

pytestmark = pytest.mark.skipif(not cpu_gemm.usable(torch.ones(1)), reason="no native AVX2 GEMM here")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,k", [(256, 256), (24, 1024), (37, 19), (16, 1)])
def test_linear_is_close_to_float64_and_rows_stand_alone(n, k):
    x, w = _randn(41, k), _randn(n, k, seed=1)
    got = cpu_gemm.linear(x, w)
    want = (x.double() @ w.double().t()).float()
    assert torch.allclose(got, want, atol=1e-5 * k**0.5, rtol=1e-5)
    for lo, hi in [(0, 1), (3, 6), (5, 17), (40, 41), (0, 41)]:
        assert torch.equal(cpu_gemm.linear(x[lo:hi], w), got[lo:hi])
    wide = torch.cat([x, _randn(41, 7, seed=2)], dim=1)[:, :k]  # strided rows take the same path
    assert torch.equal(cpu_gemm.linear(wide, w), got)


def test_portable_path_gives_the_avx2_numbers():
    lib = cpu_gemm._library()
    x = _randn(23, 70)
    weights = [_randn(45, 70, seed=1), _randn(40, 70, seed=2)]  # a full and a half last panel
    fast = [cpu_gemm.linear(x, w) for w in weights]
    try:
        lib.gemm_use_avx2(0)
        portable = [cpu_gemm.linear(x, w) for w in weights]
    finally:
        lib.gemm_use_avx2(1)
    assert all(torch.equal(a, b) for a, b in zip(portable, fast))


def test_packed_weights_follow_in_place_updates():
    x, w = _randn(5, 32), _randn(20, 32, seed=1)
    first = cpu_gemm.linear(x, w)
    w.mul_(2)
    assert torch.equal(cpu_gemm.linear(x, w), first * 2)


def test_repacking_after_an_in_place_update_reuses_the_panels():
    """An EP spare buffer refilled in place re-packs into the panels it has (no new allocation,
    whose pages would fault in beside the step loop); the panels are those of a fresh tensor."""
    w = _randn(3, 20, 32, seed=2)
    lib = cpu_native.library()
    before = cpu_gemm.packed(w, lib)
    w.copy_(_randn(3, 20, 32, seed=3))
    after = cpu_gemm.packed(w, lib)
    assert after.data_ptr() == before.data_ptr()
    assert torch.equal(after, cpu_gemm.packed(w.clone(), lib))


def test_grouped_linear_matches_the_reference_per_row():
    x, w = _randn(19, 2, 128), _randn(2, 64, 128, seed=1)
    got = cpu_gemm.grouped_linear(x, w)
    assert torch.allclose(got, torch_ref.grouped_linear(x, w), atol=1e-4)
    assert torch.equal(cpu_gemm.grouped_linear(x[4:7], w), got[4:7])


def test_moe_experts_match_per_expert_torch_gemms():
    num_experts, h, inter, limit = 4, 32, 24, 7.0
    gate_up, down = _randn(num_experts, 2 * inter, h, seed=1), _randn(num_experts, h, inter, seed=2)
    x = _randn(9, h)
    token_of_row = torch.tensor([0, 3, 8, 1, 1, 2, 5, 6, 7, 0, 4])
    segments = [(0, 0, 3), (2, 3, 4), (3, 4, 11)]
    got = cpu_gemm.moe_experts(x, token_of_row, segments, gate_up, down, limit)
    for e, first, end in segments:
        rows = x[token_of_row[first:end]]
        act = torch_ref.swiglu_clamped(rows @ gate_up[e].t(), limit)
        assert torch.allclose(got[first:end], act @ down[e].t(), atol=1e-4)
    alone = cpu_gemm.moe_experts(x, token_of_row[5:6], [(3, 0, 1)], gate_up, down, limit)
    assert torch.equal(alone[0], got[5])


def test_fused_mhc_weights_take_the_same_numbers_on_the_portable_path():
    from deepinfer.kernels import cpu_native

    t, n, d = 37, 4, 64
    streams, fn = _randn(t, n, d), _randn((2 + n) * n, n * d, seed=1) / 16
    scale, base, comb_base = _randn(2 * n, seed=2), _randn(2 * n, seed=3), _randn(n, n, seed=4)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, batch_invariant=True)
    fast = cpu_native.hc_pre(streams, fn, scale, base, 1.3, comb_base, **kw)
    lib = cpu_gemm._library()
    try:
        lib.gemm_use_avx2(0)
        portable = cpu_native.hc_pre(streams, fn, scale, base, 1.3, comb_base, **kw)
    finally:
        lib.gemm_use_avx2(1)
    want = torch_ref.hc_pre(streams, fn, scale, base, 1.3, comb_base, **kw)
    for a, b, w in zip(fast, portable, want):
        assert torch.equal(a, b) and torch.allclose(a, w, atol=1e-5)
    rows = cpu_native.hc_pre(streams[9:12], fn, scale, base, 1.3, comb_base, **kw)  # a tail of 3 rows
    assert all(torch.equal(a, b[9:12]) for a, b in zip(rows, fast))


@pytest.mark.parametrize("layer", [0, 1])  # a hash layer and a learned-routing layer
@pytest.mark.parametrize("num_tokens,num_rows", [(6, 8), (40, 40)])
def test_one_call_moe_block_is_bitwise_the_staged_native_path(layer, num_tokens, num_rows, monkeypatch):
    from deepinfer.engine.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.engine.core.model_runner import load_weights
    from deepinfer.engine.models.deepseek_v4.testing import hf_reference

    ref = hf_reference(seed=3)
    model = DeepseekV4ForCausalLM(ref.config)
    load_weights(model, ref.state_dict, tied=ref.config.tie_word_embeddings)
    model.finalize()
    moe = model.layers[layer].mlp
    assert moe.gate.is_hash == (layer == 0)
    x = _randn(num_rows, ref.config.hidden_size, seed=4)
    token_ids = torch.randint(0, ref.config.vocab_size, (num_rows,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        fused = moe.forward(x, token_ids, num_tokens, True)
        monkeypatch.setattr(cpu_gemm, "moe_forward", lambda *a, **k: None)
        staged = moe.forward(x, token_ids, num_tokens, True)
        monkeypatch.setattr(cpu_gemm, "usable", lambda *a: False)  # the torch GEMMs of the reference
        reference = moe.forward(x, token_ids, num_tokens, True)
    assert torch.equal(fused, staged)
    assert torch.allclose(fused, reference, atol=1e-4)
