"""Triton sparse MQA with sink (kernels/gpu_attention.py) against torch_ref.gathered_attention:
random token/head counts and head dims off the tiles, window and extra key sets of any length
(none, sink only, split over many programs or not), masked keys, poisoned outputs."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_attention  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()


def _case(num, heads, dim, window, extra, pool_rows, extra_rows, masked, dtype, seed):
    g = cases.gen(seed)
    q = cases.randn(num, heads, dim, dtype=dtype, gen=g)
    pool = cases.randn(pool_rows + 1, dim, dtype=dtype, gen=g)
    pool[-1] = 0  # the zero row standing for the sink
    rows = torch.randint(0, pool_rows, (num, window + 1), generator=g)
    rows[:, -1] = pool_rows
    bias = torch.where(torch.rand(num, 1, window + 1, generator=g) < masked, float("-inf"), 0.0)
    bias[..., -1] = 0
    args = [q, pool, rows.to(cases.DEVICE), bias.to(cases.DEVICE), None, None, None]
    if extra:
        args[4] = cases.randn(extra_rows, dim, dtype=dtype, gen=g)
        args[5] = torch.randint(0, extra_rows, (num, extra), generator=g).to(cases.DEVICE)
        args[6] = torch.where(torch.rand(num, 1, extra, generator=g) < masked, float("-inf"), 0.0).to(cases.DEVICE)
    sinks = cases.randn(heads, gen=g)
    return args, sinks


@cases.examples()
@given(num=st.integers(1, 70), heads=st.integers(1, 70), dim=st.sampled_from([8, 20, 64, 100, 512]),
       window=st.integers(0, 140), extra=st.sampled_from([0, 1, 7, 64, 300]), masked=st.sampled_from([0.0, 0.3, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_gathered_attention(num, heads, dim, window, extra, masked, dtype, seed):
    args, sinks = _case(num, heads, dim, window, extra, 150, 400, masked, dtype, seed)
    scale = dim**-0.5
    with cases.poisoned_allocations():
        got = gpu_attention.gathered_attention(*args, sinks, scale)
    ref_args = [a.double() if a is not None and a.is_floating_point() else a for a in args]
    want = torch_ref.gathered_attention(*ref_args, sinks.double(), scale)
    assert got.dtype == dtype and got.shape == (num, heads, dim)
    if masked == 1.0:  # every key masked: the sink takes all the weight, the output is zero
        assert torch.equal(got.float().cpu(), torch.zeros(num, heads, dim))
    else:
        assert cases.rel_err(got, want) < cases.tol(dtype)


def test_decode_shape_uses_splits_and_matches():
    """V4-Flash decode: 64 heads x 512, 128 window rows + 512 picked entries, one token (the
    flash-decoding split path) and 64 tokens (one program per head block)."""
    for num in (1, 64):
        args, sinks = _case(num, 64, 512, 128, 512, 200, 2000, 0.1, torch.bfloat16, num)
        got = gpu_attention.gathered_attention(*args, sinks, 512**-0.5)
        ref_args = [a.double() if a.is_floating_point() else a for a in args]
        want = torch_ref.gathered_attention(*ref_args, sinks.double(), 512**-0.5)
        assert cases.rel_err(got, want) < cases.BF16_TOL


def test_zero_tokens():
    args, sinks = _case(1, 4, 16, 3, 0, 5, 0, 0.0, torch.float32, 0)
    empty = [args[0][:0], args[1], args[2][:0], args[3][:0], None, None, None]
    assert gpu_attention.gathered_attention(*empty, sinks, 0.25).shape == (0, 4, 16)
