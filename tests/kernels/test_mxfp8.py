"""MXFP8 rows: byte layout, exact sizes, round-trip error within the format's bound."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import mxfp8


def _random_rows(num_rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes over 40 binades, plus a few rows with outliers, as K=V rows have
    x = torch.randn(num_rows, dim, generator=g) * torch.exp2(torch.randint(-20, 20, (num_rows, 1), generator=g).float())
    x[::7, 3] *= 1000.0
    return x


@pytest.mark.parametrize("dim", [32, 64, 512])
def test_round_trip_within_format_bound(dim):
    x = _random_rows(257, dim, seed=dim)
    y = mxfp8.unpack_rows(mxfp8.pack_rows(x), dim)
    err = (x - y).abs()
    # bound derived in the module docstring: half an e4m3 step (2^-3 relative) of each normal
    # value plus half the subnormal step, after power-of-two block scaling
    k = mxfp8.block_exponents(x).float().repeat_interleave(32, dim=-1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * torch.exp2(k)
    assert torch.all(err <= bound), f"max err/bound {(err / bound).max():.3f}"
    assert torch.equal(bound, mxfp8.error_bound(x))
    # the bound is tight enough to mean something: about 3 significant bits survive
    rel = (err.norm() / x.norm()).item()
    assert 1e-3 < rel < 2.0**-4


def test_scale_choice_never_saturates_and_is_minimal():
    x = torch.tensor([[448.0] * 32, [449.0] * 32, [224.0] + [0.0] * 31, [1e-30] * 32, [0.0] * 32])
    k = mxfp8.block_exponents(x)[:, 0].tolist()
    assert k == [0, 1, -1, -108, -127]  # 1e-30 = 1.26 * 2^-100 = 448 * 2^-108.4
    y = mxfp8.unpack_rows(mxfp8.pack_rows(x), 32)
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2]) and torch.equal(y[4], x[4])
    assert (y[1] - x[1]).abs().max() <= 449.0 * 2**-4  # 449 is not representable at scale 2


def test_packed_layout_is_values_then_scales():
    x = torch.randn(3, 64)
    values, scales = mxfp8.quantize(x)
    packed = mxfp8.pack_rows(x)
    assert packed.shape == (3, 66) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, :64], values) and torch.equal(packed[:, 64:], scales)
    assert torch.equal(values.view(torch.float8_e4m3fn).float(), (x / torch.exp2(scales.float() - 127).repeat_interleave(32, -1)).to(torch.float8_e4m3fn).float())


def test_byte_sizes():
    assert mxfp8.row_bytes(512) == 528
    assert mxfp8.row_bytes(64) == 66
    assert mxfp8.row_bytes(32) == 33
    assert mxfp8.pack_rows(torch.randn(134, 512)).numel() == 134 * 528


def test_pack_into_preallocated_view():
    arena = torch.zeros(2, 10 * 66, dtype=torch.uint8)
    x = torch.randn(10, 64)
    mxfp8.pack_rows(x, out=arena[1].view(10, 66))
    assert torch.equal(arena[1].view(10, 66), mxfp8.pack_rows(x)) and not arena[0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    x = torch.randn(4, 64).to(dtype)
    y = mxfp8.unpack_rows(mxfp8.pack_rows(x), 64, dtype)
    assert y.dtype == dtype
    assert torch.all((x.float() - y.float()).abs() <= mxfp8.error_bound(x) + 2.0**-8 * x.float().abs())


def test_bad_shapes_raise_one_line_errors():
    with pytest.raises(mxfp8.Mxfp8Error, match="multiple of 32"):
        mxfp8.pack_rows(torch.randn(2, 48))
    with pytest.raises(mxfp8.Mxfp8Error, match="expected 66"):
        mxfp8.unpack_rows(torch.zeros(2, 64, dtype=torch.uint8), 64)
    with pytest.raises(mxfp8.Mxfp8Error, match="floating-point"):
        mxfp8.quantize(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = _random_rows(64, 512, seed=1)
    assert torch.equal(mxfp8.pack_rows(x.cuda()).cpu(), mxfp8.pack_rows(x))
