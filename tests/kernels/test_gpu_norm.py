"""Triton RMSNorm / RoPE kernels (kernels/gpu_norm.py) against torch_ref on random shapes: rows
given by strided views, widths off the 1024-channel step, bf16 and float32, poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_norm  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _tables(rows: int, rope_dim: int, seed: int):
    positions = torch.randint(0, 5000, (rows,), generator=cases.gen(seed))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    cos, sin = torch_ref.rope_tables(positions, inv_freq)
    return cos.to(cases.DEVICE), sin.to(cases.DEVICE)


def _rows(rows: int, heads: int, dim: int, extra: int, dtype, seed: int) -> torch.Tensor:
    """A strided ``[rows, heads, dim]`` view (or ``[rows, dim]`` when heads is 0) of a wider tensor."""
    g = cases.gen(seed)
    wide = cases.randn(rows, max(heads, 1) * dim + extra, dtype=dtype, gen=g, scale=3.0)
    part = wide[:, : max(heads, 1) * dim]
    return part.view(rows, heads, dim) if heads else part


@cases.examples()
@given(rows=st.integers(1, 9), heads=st.sampled_from([0, 1, 3, 8]), dim=st.sampled_from([1, 37, 512, 1100, 2100]),
       extra=st.integers(0, 9), weighted=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_rms_norm(rows, heads, dim, extra, weighted, dtype, seed):
    x = _rows(rows, heads, dim, extra, dtype, seed)
    w = (torch.rand(dim, generator=cases.gen(seed + 1)) + 0.5).to(cases.DEVICE) if weighted else None
    with cases.poisoned_allocations():
        got = gpu_norm.rms_norm(x, w, 1e-6)
    want = torch_ref.rms_norm(x.double(), w, 1e-6)
    assert got.dtype == x.dtype and got.is_contiguous()
    assert cases.rel_err(got, want) < cases.tol(dtype)


@cases.examples()
@given(rows=st.integers(1, 9), heads=st.sampled_from([0, 1, 5, 16]), dim=st.sampled_from([8, 24, 64, 130, 512]),
       rope=st.sampled_from([2, 8, 64]), weighted=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_rms_norm_rope_and_apply_rope(rows, heads, dim, rope, weighted, dtype, seed):
    rope = min(rope, dim - dim % 2)
    x = _rows(rows, heads, dim, 3, dtype, seed)
    w = (torch.rand(dim, generator=cases.gen(seed + 1)) + 0.5).to(cases.DEVICE) if weighted else None
    cos, sin = _tables(rows, rope, seed)
    with cases.poisoned_allocations():
        got = gpu_norm.rms_norm_rope(x, w, 1e-6, cos, sin)
    want = torch_ref.rms_norm_rope(x.double(), w, 1e-6, cos.double(), sin.double())
    assert cases.rel_err(got, want) < cases.tol(dtype)
    # in place, on a contiguous tensor and on a strided one; the plain channels stay untouched
    for y in (x.contiguous().clone(), x.clone()):
        before = y.clone()
        assert gpu_norm.apply_rope_(y, cos, sin) is y
        want = torch_ref.apply_rope_(before.double(), cos.double(), sin.double())
        assert cases.rel_err(y, want) < cases.tol(dtype)
        assert torch.equal(y[..., : dim - rope], before[..., : dim - rope])


def test_empty_rows_and_bad_tables():
    x = torch.empty(0, 4, 64, device=cases.DEVICE)
    assert gpu_norm.rms_norm(x, None, 1e-6).shape == (0, 4, 64)
    cos, sin = _tables(3, 8, 0)
    with pytest.raises(ValueError, match="rope tables"):
        gpu_norm.rms_norm_rope(torch.ones(2, 64, device=cases.DEVICE), None, 1e-6, cos, sin)
