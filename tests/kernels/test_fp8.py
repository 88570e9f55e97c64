"""kernels/fp8.py: block-scaled FP8 weights and the numbers of a GEMM over them (the oracle of
the Triton FP8 kernels), on the CPU: quantisation error bounds, exact round trips of values
already on the grid, the per-group input quantisation, linear / grouped_linear / moe_experts_
through torch_ref against the module docstring's sum written out in float64, batch invariance,
and one-line errors for weights whose scale does not fit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kernels import cpu_gemm, fp8, ops, torch_ref
from deepinfer.kernels.fp8 import BLOCK, FP8_MAX, Fp8FormatError, Fp8Weight

pytestmark = pytest.mark.timeout(120)
SIZES = st.integers(1, 300)


def _rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a few large outliers per matrix, as trained weights have: block scales must follow them
    x = torch.randn(*shape, generator=g) * scale
    return x * torch.where(torch.rand(*shape, generator=g) < 0.01, 20.0, 1.0)


def _e4m3_grid() -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0).unique()


@settings(max_examples=25, deadline=None)
@given(lead=st.sampled_from([(), (1,), (3,)]), n=SIZES, k=SIZES, fmt=st.sampled_from(fp8.SCALE_FORMATS),
       seed=st.integers(0, 2**31))
def test_quantize_error_and_layout(lead, n, k, fmt, seed):
    w = _rand(*lead, n, k, seed=seed)
    q = Fp8Weight.quantize(w, fmt)
    assert q.data.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert q.scale.shape == (*lead, -(-n // BLOCK), -(-k // BLOCK)) and q.scale.dtype == torch.float32
    back = q.dequantize()
    # per element: half a step of E4M3 (2^-4 relative for normals) at its block's scale, or the
    # subnormal step for values far below the block's largest
    s = q.scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-9)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert (q.data.float().abs() <= FP8_MAX).all()
    if fmt == "ue8m0":
        assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))  # powers of two


@settings(max_examples=15, deadline=None)
@given(n=SIZES, k=SIZES, seed=st.integers(0, 2**31))
def test_values_on_the_grid_round_trip_exactly(n, k, seed):
    """An FP8 checkpoint's weights, dequantised by the loader, quantise back to themselves with
    UE8M0 scales (what serving a checkpoint stored in FP8 relies on), and float scales round-trip
    their own dequantised values."""
    g = torch.Generator().manual_seed(seed)
    grid = _e4m3_grid()
    codes = grid[torch.randint(len(grid), (n, k), generator=g)]
    exps = torch.randint(-8, 8, (-(-n // BLOCK), -(-k // BLOCK)), generator=g).float()
    scale = torch.exp2(exps)
    w = codes * scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    assert torch.equal(Fp8Weight.quantize(w, "ue8m0").dequantize(), w)
    once = Fp8Weight.quantize(_rand(n, k, seed=seed), "float").dequantize()
    assert torch.equal(Fp8Weight.quantize(once, "float").dequantize(), once)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 20), k=SIZES, seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_rows(m, k, seed, dtype):
    x = _rand(m, k, seed=seed, scale=3.0).to(dtype)
    if m > 1:
        x[1] = 0.0  # an all-zero row: scale 1, zeros
    q, s = fp8.quantize_rows(x)
    assert q.shape == x.shape and s.shape == (m, -(-k // BLOCK))
    groups = torch.nn.functional.pad(x.float(), (0, s.shape[1] * BLOCK - k)).view(m, s.shape[1], BLOCK)
    amax = groups.abs().amax(-1)
    assert torch.equal(s, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
    # q is the nearest grid value of x * (448 / amax) (the amax element lands on +-448)
    grid = _e4m3_grid()
    r = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax.clamp(min=1e-38), torch.ones_like(amax))
    scaled = (x.float() * r.repeat_interleave(BLOCK, 1)[:, :k]).clamp(-FP8_MAX, FP8_MAX)
    nearest = (scaled.unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.allclose((q.float() - scaled).abs(), nearest, atol=0.0, rtol=0.0)
    if m > 1:
        assert not q[1].float().any()


def _linear_by_groups(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The module docstring's sum, written out group by group in float64."""
    q, s = fp8.quantize_rows(x)
    n, k = w.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(-(-k // BLOCK)):
        cols = slice(g * BLOCK, min(k, (g + 1) * BLOCK))
        part = q[:, cols].double() @ w.data[:, cols].double().t()
        ws = w.scale[:, g].double().repeat_interleave(BLOCK)[:n]
        out += part * s[:, g].double()[:, None] * ws[None, :]
    return out


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 40), n=SIZES, k=SIZES, fmt=st.sampled_from(fp8.SCALE_FORMATS), invariant=st.booleans(),
       seed=st.integers(0, 2**31))
def test_linear_is_the_sum_over_groups(m, n, k, fmt, invariant, seed):
    x, w = _rand(m, k, seed=seed), Fp8Weight.quantize(_rand(n, k, seed=seed + 1), fmt)
    want = _linear_by_groups(x, w)
    for got in (fp8.linear_ref(x, w), torch_ref.linear(x, w, invariant), ops.linear(x, w, invariant)):
        assert got.dtype == x.dtype and got.shape == (m, n)
        assert (got.double() - want).norm() <= 1e-5 * want.norm() + 1e-6


def test_linear_rows_do_not_depend_on_the_batch():
    x, w = _rand(37, 200, seed=1), Fp8Weight.quantize(_rand(150, 200, seed=2))
    whole = ops.linear(x, w, True)
    for m in (1, 3, 12, 17):
        assert torch.equal(ops.linear(x[:m], w, True), whole[:m])


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 20), g=st.integers(1, 5), n=SIZES, k=SIZES, seed=st.integers(0, 2**31))
def test_grouped_linear(m, g, n, k, seed):
    x, w = _rand(m, g, k, seed=seed), Fp8Weight.quantize(_rand(g, n, k, seed=seed + 1))
    want = torch.stack([_linear_by_groups(x[:, i], w[i]) for i in range(g)], dim=1)
    for got in (fp8.grouped_linear_ref(x, w), ops.grouped_linear(x, w, False), ops.grouped_linear(x, w, True)):
        assert got.shape == (m, g, n) and (got.double() - want).norm() <= 1e-5 * want.norm() + 1e-6


def test_moe_experts_with_fp8_experts_is_expert_by_expert():
    e, h, inter, t, k = 5, 150, 70, 9, 2
    gate_up = Fp8Weight.quantize(_rand(e, 2 * inter, h, seed=3))
    down = Fp8Weight.quantize(_rand(e, h, inter, seed=4))
    x = _rand(t + 2, h, seed=5)  # rows past t are not routed
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    out = torch_ref.moe_experts_(torch.zeros(t + 2, h), x, ids, weights, gate_up, down, 7.0)
    want = torch.zeros(t + 2, h)
    for i in range(t):
        for j in range(k):
            hidden = fp8.linear_ref(x[i : i + 1], gate_up[int(ids[i, j])])
            act = torch_ref.swiglu_clamped(hidden, 7.0)
            want[i] += weights[i, j] * fp8.linear_ref(act, down[int(ids[i, j])])[0]
    assert (out - want).norm() <= 1e-5 * want.norm() and not out[t:].any()


def test_cpu_gemm_leaves_fp8_weights_to_the_reference():
    w = Fp8Weight.quantize(_rand(64, 64, seed=0))
    x = _rand(4, 64, seed=1)
    assert not cpu_gemm.usable(x, w)
    assert torch.equal(cpu_gemm.linear(x, w), torch_ref.linear(x, w))


def test_bad_weights_fail_with_one_line():
    data = torch.zeros(130, 70).to(torch.float8_e4m3fn)
    with pytest.raises(Fp8FormatError, match=r"scale shape \(1, 1\) does not tile weight \(130, 70\)"):
        Fp8Weight(data, torch.ones(1, 1))
    with pytest.raises(Fp8FormatError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 4), torch.ones(1, 1))
    with pytest.raises(Fp8FormatError, match="scale_format"):
        Fp8Weight.quantize(torch.zeros(4, 4), "e4m3")
    with pytest.raises(Fp8FormatError, match="input has 5 columns"):
        fp8.linear_ref(torch.zeros(2, 5), Fp8Weight.quantize(torch.zeros(3, 4)))
