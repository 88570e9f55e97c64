"""Triton FP8 GEMMs (kernels/gpu_fp8.py) against kernels/fp8.py's oracles: ``linear`` and
``grouped_linear`` over random shapes off the 128-column groups and the tiles (both tile shapes:
rows on either side of the decode/prefill switch), both scale formats, float32 and bf16 inputs,
batch-invariant or not, poisoned outputs; batch invariance bitwise; strided inputs; the routing
of FP8 weights; ``quantize_rows`` bitwise the reference's, rounding carries and subnormals included."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from deepinfer.kernels import fp8
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_fp8, gpu_routing  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
FORMATS = st.sampled_from(fp8.SCALE_FORMATS)
SWITCH = gpu_fp8._SMALL_M
ROWS = st.one_of(st.sampled_from([1, SWITCH, SWITCH + 1]), st.integers(1, 200))
# float32 outputs: the interpreter's products are exact and its sums float32 (another order than the
# oracle's); Hopper's FP8 tensor cores keep the running sum of a 128-column group in ~13 mantissa bits
# (the FP22 accumulator DeepSeek and SageAttention measured; ~1.2e-4 in a simulation of these shapes)
F32_TOL = 5e-4 if cases.HAS_CUDA else 1e-5


def _weight(*shape, scale_format: str, gen: torch.Generator) -> fp8.Fp8Weight:
    dense = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    return fp8.Fp8Weight.quantize(dense, scale_format).to(cases.DEVICE)


def _tol(dtype: torch.dtype) -> float:
    return F32_TOL if dtype == torch.float32 else cases.BF16_TOL


@cases.examples()
@given(m=ROWS, n=st.integers(1, 600), k=st.integers(1, 700), dtype=DTYPES, scale_format=FORMATS,
       batch_invariant=st.booleans(), seed=st.integers(0, 2**31))
@example(m=1, n=65, k=129, dtype=torch.bfloat16, scale_format="ue8m0", batch_invariant=False, seed=0)  # decode tiles
@example(m=SWITCH + 1, n=129, k=257, dtype=torch.float32, scale_format="float", batch_invariant=False, seed=1)
def test_linear(m, n, k, dtype, scale_format, batch_invariant, seed):
    g = cases.gen(seed)
    x = cases.randn(m, k, dtype=dtype, gen=g, scale=3.0)
    weight = _weight(n, k, scale_format=scale_format, gen=g)
    with cases.poisoned_allocations():
        got = gpu_fp8.linear(x, weight, batch_invariant)
    assert got.dtype == dtype and got.shape == (m, n)
    # against the oracle's float32 result (rel_err compares in float64): a bf16 output is one rounding off it
    assert cases.rel_err(got, fp8.linear_ref(x.float(), weight)) < _tol(dtype)


@cases.examples()
@given(m=st.sampled_from([1, 3, SWITCH + 6]), groups=st.integers(1, 9), n=st.integers(1, 300),
       k=st.integers(1, 400), dtype=DTYPES, scale_format=FORMATS, batch_invariant=st.booleans(),
       seed=st.integers(0, 2**31))
@example(m=SWITCH + 6, groups=8, n=130, k=200, dtype=torch.float32, scale_format="ue8m0", batch_invariant=False, seed=2)
def test_grouped_linear(m, groups, n, k, dtype, scale_format, batch_invariant, seed):
    g = cases.gen(seed)
    x = cases.randn(m, groups, k, dtype=dtype, gen=g, scale=3.0)
    weight = _weight(groups, n, k, scale_format=scale_format, gen=g)
    with cases.poisoned_allocations():
        got = gpu_fp8.grouped_linear(x, weight, batch_invariant)
    assert got.dtype == dtype and got.shape == (m, groups, n)
    assert cases.rel_err(got, fp8.grouped_linear_ref(x.float(), weight)) < _tol(dtype)


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    g = cases.gen(1)
    x = cases.randn(150, 300, dtype=torch.bfloat16, gen=g, scale=3.0)
    weight = _weight(200, 300, scale_format="ue8m0", gen=g)
    full = gpu_fp8.linear(x, weight, batch_invariant=True)
    for start, stop in [(0, 1), (7, 8), (0, SWITCH), (3, SWITCH + 4), (20, 150)]:
        assert torch.equal(gpu_fp8.linear(x[start:stop], weight, batch_invariant=True), full[start:stop])
    xg = cases.randn(90, 3, 200, dtype=torch.bfloat16, gen=g)
    wg = _weight(3, 130, 200, scale_format="float", gen=g)
    full = gpu_fp8.grouped_linear(xg, wg, batch_invariant=True)
    assert torch.equal(gpu_fp8.grouped_linear(xg[5:6], wg, batch_invariant=True), full[5:6])
    assert torch.equal(gpu_fp8.grouped_linear(xg[:SWITCH + 9], wg, batch_invariant=True), full[:SWITCH + 9])


def test_strided_inputs_and_empty_batches():
    g = cases.gen(2)
    k, n = 260, 140
    weight = _weight(n, k, scale_format="float", gen=g)
    wide = cases.randn(SWITCH + 3, k + 37, dtype=torch.float32, gen=g)
    for x in (wide[:, 5 : 5 + k], wide[:3, :k], wide[:, :k].t().contiguous().t()):  # row strides, column-major
        with cases.poisoned_allocations():
            got = gpu_fp8.linear(x, weight)
        assert torch.equal(got, gpu_fp8.linear(x.contiguous(), weight))
        assert cases.rel_err(got, fp8.linear_ref(x, weight)) < F32_TOL
    groups = 3
    wg = _weight(groups, n, k, scale_format="ue8m0", gen=g)
    rows = cases.randn(5, groups * k + 11, dtype=torch.bfloat16, gen=g)
    gapped = rows[:, 3 : 3 + groups * (k + 1)].view(5, groups, k + 1)[..., :k]  # groups k + 1 apart: copied
    for x in (rows[:, : groups * k].view(5, groups, k), gapped):
        with cases.poisoned_allocations():
            got = gpu_fp8.grouped_linear(x, wg)
        assert torch.equal(got, gpu_fp8.grouped_linear(x.contiguous(), wg))
        assert cases.rel_err(got, fp8.grouped_linear_ref(x.float(), wg)) < cases.BF16_TOL
    assert gpu_fp8.linear(wide[:0, :k], weight).shape == (0, n)
    assert gpu_fp8.grouped_linear(rows[:0, : groups * k].view(0, groups, k), wg).shape == (0, groups, n)
    none = fp8.Fp8Weight.quantize(torch.zeros(0, k)).to(cases.DEVICE)
    assert gpu_fp8.linear(wide[:, :k], none).shape == (SWITCH + 3, 0)


def test_fp8_weights_route_to_the_kernels_and_dense_ones_do_not():
    x = torch.randn(4, 256)
    weight = fp8.Fp8Weight.quantize(torch.randn(64, 256))
    kernel, fits = gpu_routing.KERNELS["linear"]
    assert kernel is gpu_fp8.linear and fits(x, weight) and fits(x.bfloat16(), weight)
    assert not fits(x, weight.dequantize()) and not fits(x[:, :128], weight) and not fits(x.double(), weight)
    kernel, fits = gpu_routing.KERNELS["grouped_linear"]
    stacked = fp8.Fp8Weight.quantize(torch.randn(2, 64, 256))
    assert kernel is gpu_fp8.grouped_linear and fits(x.view(2, 2, 256), stacked)
    assert not fits(x.view(2, 2, 256), stacked.dequantize()) and not fits(x.view(1, 4, 256), stacked)


def test_quantize_rows_is_bitwise_the_reference():
    g = cases.gen(3)
    k = 300  # two full groups and a short one
    x = torch.randn(40, k, generator=g) * torch.logspace(-6, 6, 40)[:, None]
    x[3] = 0.0  # an all-zero row: scale 1
    x[4, 128:256] = 0.0  # and an all-zero group
    # a group whose largest value sets s = 448 / 448: the others are their own E4M3 inputs, halfway
    # values and values just under a binade that round up across it (7.96 -> 8, 0.01562 -> 2^-6)
    x[5, :128] = torch.tensor([448.0, 7.96, 15.9, 3.999, 0.0156, 0.01562, 5.0 / 1024, 2**-10, -2**-10, 2**-9 * 1.5]
                              + [1.0 + i / 64 for i in range(118)])
    # tiny values beside a large one: x / s falls in E4M3's subnormal range (< 2^-6), some below 2^-10 (-> 0)
    x[6:10, 128:256] = torch.randn(4, 128, generator=g) * torch.tensor([1e-2, 1e-3, 1e-4, 1e-5])[:, None]
    x[6:10, 130] = 1.0
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype).to(cases.DEVICE)
        with cases.poisoned_allocations():
            q, s = gpu_fp8.quantize_rows(xs)
        want_q, want_s = fp8.quantize_rows(xs)
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        # the subnormals are really there
        subnormal = (q.float().abs() < 2**-6) & (q.float() != 0)
        assert subnormal[6:10].sum() > 100


def test_decode_splits_k_where_few_column_tiles_would_run():
    """Decode tiles cut K in ranges when the weight has few column tiles (a 1536 x 4096 projection
    is 24 of them): the ranges' float32 sums are added in order, the same for every M."""
    few, many = gpu_fp8._tiles(1, 300, 1000, False), gpu_fp8._tiles(1, 64 * 300, 1000, False)
    assert few.swap and few.splits > 1 and few.splits * few.per_split >= 8 and many.splits == 1
    g = cases.gen(5)
    weight = _weight(300, 1000, scale_format="float", gen=g)
    x = cases.randn(9, 1000, dtype=torch.bfloat16, gen=g, scale=3.0)
    with cases.poisoned_allocations():
        got = gpu_fp8.linear(x, weight)
    assert cases.rel_err(got, fp8.linear_ref(x.float(), weight)) < cases.BF16_TOL
    assert torch.equal(gpu_fp8.linear(x[:1], weight), got[:1])
