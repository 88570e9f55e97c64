"""Triton mHC kernels (kernels/gpu_mhc.py) against torch_ref: hc_pre (mixes, Sinkhorn, collapse),
hc_post, hc_head and sinkhorn on random stream counts, widths and token counts, poisoned outputs."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_mhc  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
KW = dict(norm_eps=1e-6, hc_eps=1e-6)


def _weights(n: int, d: int, seed: int):
    g = cases.gen(seed)
    fn = cases.randn((2 + n) * n, n * d, gen=g, scale=(n * d) ** -0.5)
    scale = 1 + 0.2 * cases.randn(2 * n, gen=g)
    base = 0.2 * cases.randn(2 * n, gen=g)
    comb_base = 0.2 * cases.randn(n, n, gen=g)
    return fn, scale, base, comb_base


@cases.examples()
@given(t=st.one_of(st.integers(1, 40), st.integers(41, 200)), n=st.integers(1, 4),
       d=st.sampled_from([1, 40, 600, 1030]), iters=st.sampled_from([1, 2, 20]),
       dtype=DTYPES, seed=st.integers(0, 2**31))
def test_hc_pre(t, n, d, iters, dtype, seed):
    streams = cases.randn(t, n, d, dtype=dtype, gen=cases.gen(seed), scale=2.0)
    fn, scale, base, comb_base = _weights(n, d, seed + 1)
    with cases.poisoned_allocations():
        post, comb, collapsed = gpu_mhc.hc_pre(streams, fn, scale, base, 1.3, comb_base, sinkhorn_iters=iters, **KW)
    # the reference's weights are float32 math in any dtype (its linear takes no float64): it runs
    # on the exact float32 upcast of the inputs
    want = torch_ref.hc_pre(streams.float(), fn, scale, base, 1.3, comb_base, sinkhorn_iters=iters, **KW)
    assert cases.rel_err(post, want[0]) < cases.F32_TOL * 10
    assert cases.rel_err(comb, want[1]) < cases.F32_TOL * 10
    assert collapsed.dtype == dtype and cases.rel_err(collapsed, want[2]) < cases.tol(dtype)


@cases.examples()
@given(t=st.integers(1, 40), n=st.integers(1, 4), d=st.sampled_from([1, 40, 600, 1030]), dtype=DTYPES,
       seed=st.integers(0, 2**31))
def test_hc_post_and_head(t, n, d, dtype, seed):
    g = cases.gen(seed)
    streams = cases.randn(t, n, d, dtype=dtype, gen=g)
    block_out = cases.randn(t, d, dtype=dtype, gen=g)
    post = torch.rand(t, n, generator=g).to(cases.DEVICE) * 2
    comb = torch.rand(t, n, n, generator=g).to(cases.DEVICE)
    with cases.poisoned_allocations():
        got = gpu_mhc.hc_post(block_out, streams, post, comb)
    # the reference mixes in the streams' dtype: post and comb rounded to it
    want = torch_ref.hc_post(block_out.double(), streams.double(), post.to(dtype).double(), comb.to(dtype).double())
    assert got.dtype == dtype and cases.rel_err(got, want) < cases.tol(dtype)
    fn = cases.randn(n, n * d, gen=g, scale=(n * d) ** -0.5)
    base, scale = 0.2 * cases.randn(n, gen=g), 1 + 0.2 * cases.randn(1, gen=g)
    with cases.poisoned_allocations():
        got = gpu_mhc.hc_head(streams, fn, base, scale, **KW)
    want = torch_ref.hc_head(streams.float(), fn, base, scale, **KW)
    assert cases.rel_err(got, want) < cases.tol(dtype)


@cases.examples()
@given(t=st.integers(1, 300), n=st.integers(1, 8), iters=st.integers(0, 25), seed=st.integers(0, 2**31))
def test_sinkhorn(t, n, iters, seed):
    comb = (torch.rand(t, n, n, generator=cases.gen(seed)) + 1e-3).to(cases.DEVICE)
    with cases.poisoned_allocations():
        got = gpu_mhc.sinkhorn(comb, iters, 1e-6)
    want = torch_ref.sinkhorn(comb.double().cpu().clone(), iters, 1e-6)
    assert cases.rel_err(got, want) < cases.F32_TOL


def test_zero_tokens():
    streams = torch.empty(0, 4, 64, device=cases.DEVICE)
    fn, scale, base, comb_base = _weights(4, 64, 0)
    post, comb, collapsed = gpu_mhc.hc_pre(streams, fn, scale, base, 1.0, comb_base, sinkhorn_iters=20, **KW)
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and collapsed.shape == (0, 64)
