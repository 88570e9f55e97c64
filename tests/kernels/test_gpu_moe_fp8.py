"""The routed experts over FP8 weights (kernels/gpu_moe_fp8.py through gpu_moe.moe_experts_) against
torch_ref.moe_experts_ with the same Fp8Weight experts: any number of tokens / experts / slots, sizes
off 128 and off the tiles, decode and prefill tiles, both scale formats, poisoned outputs.

The SwiGLU rows between the two GEMMs are quantised to E4M3 again, so two values a rounding apart
(the kernel's rows are in x's dtype, the reference's in float64; float32 sums in another order)
can take neighbouring E4M3 values, ~6% apart: in bf16 a few percent of the elements do, in float32
a rare one. End to end the kernels are therefore only FP8-close to the reference; each GEMM is
checked tightly on the kernels' own SwiGLU rows (recorded), where the quantised inputs are equal.
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from deepinfer.kernels.fp8 import Fp8Weight
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_moe, gpu_moe_fp8  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
LIMIT = 1.5
# float32 GEMMs: the interpreter's FP8 products are exact and its sums float32 (another order than the
# oracle's); Hopper's FP8 tensor cores keep a 128-column group's running sum in ~13 mantissa bits
# (as tests/kernels/test_gpu_fp8.py)
F32_TOL = 5e-4 if cases.HAS_CUDA else 1e-5
FLIP_TOL = 5e-2  # end to end: E4M3 neighbours in the SwiGLU rows (module docstring); seen up to 1.8e-2
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
SCALE_FORMATS = st.sampled_from(["float", "ue8m0"])


@st.composite
def shapes(draw, prefill: bool):
    """(t, e, k, h, i, batch_invariant). Prefill: pairs t * k just past gpu_moe._SMALL_PAIRS, which
    take the prefill tiles (the decode tiles when batch-invariant), h and i small; decode: fewer."""
    e = draw(st.sampled_from([1, 5, 64]))
    k = min(e, draw(st.sampled_from([1, 2, 6, 16])))
    if prefill:
        t = gpu_moe._SMALL_PAIRS // k + draw(st.integers(1, 40 // k + 1))
        h, i = draw(st.sampled_from([40, 130])), draw(st.sampled_from([24, 136]))
    else:
        t = draw(st.integers(1, 48 // k + 1))
        h, i = draw(st.sampled_from([40, 128, 300])), draw(st.sampled_from([3, 64, 200]))
    return t, e, k, h, i, draw(st.booleans())


@cases.examples()
@given(shape=shapes(prefill=False), extra_rows=st.integers(0, 3), dtype=DTYPES, scale_format=SCALE_FORMATS,
       seed=st.integers(0, 2**31))
@example(shape=(3, 64, 16, 300, 200, False), extra_rows=1, dtype=torch.float32, scale_format="ue8m0", seed=2)
def test_moe_experts_fp8_decode(shape, extra_rows, dtype, scale_format, seed):
    check_moe_experts(shape, extra_rows, dtype, scale_format, seed)


@cases.examples()
@given(shape=shapes(prefill=True), extra_rows=st.integers(0, 3), dtype=DTYPES, scale_format=SCALE_FORMATS,
       seed=st.integers(0, 2**31))
@example(shape=(530, 5, 2, 130, 136, False), extra_rows=2, dtype=torch.float32, scale_format="float", seed=1)
def test_moe_experts_fp8_prefill(shape, extra_rows, dtype, scale_format, seed):
    check_moe_experts(shape, extra_rows, dtype, scale_format, seed)


def check_moe_experts(shape, extra_rows, dtype, scale_format, seed):
    t, e, k, h, i, batch_invariant = shape
    g = cases.gen(seed)
    x = blocky_randn(t + extra_rows, 1, h, gen=g)[:, 0].to(dtype)
    gate_up = Fp8Weight.quantize(blocky_randn(e, 2 * i, h, gen=g) * h**-0.5, scale_format)
    down = Fp8Weight.quantize(blocky_randn(e, h, i, gen=g) * i**-0.5, scale_format)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(dim=-1).values.to(cases.DEVICE)
    weights = torch.rand(t, k, generator=g).to(cases.DEVICE)
    out = cases.randn(t + extra_rows, h, dtype=dtype, gen=g)
    with cases.poisoned_allocations(), recorded_swiglu_rows() as calls:
        got = gpu_moe.moe_experts_(out.clone(), x, ids, weights, gate_up, down, LIMIT, batch_invariant)
    assert torch.equal(got[t:], out[t:])  # rows past T: untouched
    (*_, swap), _ = calls[0]
    assert swap == (t * k <= gpu_moe._SMALL_PAIRS or batch_invariant)  # the tiles this case meant
    # each GEMM, on the kernels' own SwiGLU rows
    want_act, act, want_out = gemms_on_recorded_rows(calls[0], out[:t], ids, weights, down)
    tol = F32_TOL if dtype == torch.float32 else cases.BF16_TOL
    assert cases.rel_err(act, want_act) < tol
    assert cases.rel_err(got[:t], want_out) < tol
    # end to end
    want = torch_ref.moe_experts_(out[:t].double(), x.double(), ids, weights.double(), gate_up, down, LIMIT)
    assert cases.rel_err(got[:t], want) < FLIP_TOL


def blocky_randn(num: int, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """``[num, rows, cols]`` float32 normal values times a factor in [1/4, 4) per 128 x 128 block, so a
    weight block's or an input group's scale taken from the wrong place shows."""
    factor = torch.exp2(4.0 * torch.rand(num, -(-rows // 128), -(-cols // 128), generator=gen) - 2.0)
    factor = factor.repeat_interleave(128, dim=1)[:, :rows].repeat_interleave(128, dim=2)[:, :, :cols]
    return (torch.randn(num, rows, cols, generator=gen) * factor).to(cases.DEVICE)


@contextlib.contextmanager
def recorded_swiglu_rows():
    """Record gpu_moe_fp8.up_rows' calls: [((x, gate_up, tok, block_expert, t, limit, bm, swap), act)]."""
    calls, up_rows = [], gpu_moe_fp8.up_rows

    def record(*args):
        calls.append((args, up_rows(*args)))
        return calls[-1][1]

    gpu_moe_fp8.up_rows = record
    try:
        yield calls
    finally:
        gpu_moe_fp8.up_rows = up_rows


def gemms_on_recorded_rows(call, out, ids, weights, down):
    """float64 (want_act, act, want_out): the SwiGLU rows the up kernel should have written (its live
    dispatch rows), those it wrote, and ``out`` plus the combined down GEMM over the rows it wrote."""
    (x, gate_up, tok, block_expert, t, limit, bm, _), act = call
    tok, block_expert = tok.long(), block_expert.long()
    live = (tok < t).nonzero()[:, 0]
    expert = block_expert[live // bm]
    want_act = torch.zeros(len(live), act.shape[1], dtype=torch.float64, device=x.device)
    y = torch.zeros(len(tok), down.shape[1], dtype=torch.float64, device=x.device)
    for e in expert.unique().tolist():
        rows = live[expert == e]
        hidden = torch_ref.linear(x[tok[rows]], gate_up[e]).double()  # rounded to x's dtype
        want_act[expert == e] = torch_ref.swiglu_clamped(hidden, limit)
        y[rows] = torch_ref.linear(act[rows].double(), down[e])
    # the dispatch row of each (token, slot): a token's ids are distinct
    num_experts = len(gate_up)
    row_of = torch.full((t * num_experts,), -1, dtype=torch.int64, device=x.device)
    row_of[tok[live] * num_experts + expert] = live
    row_of_pair = row_of[torch.arange(t, device=x.device)[:, None] * num_experts + ids].reshape(-1)
    assert (row_of_pair >= 0).all(), "a (token, slot) pair has no dispatch row"
    y = y.to(x.dtype).double()  # the kernel's rows are in x's dtype; combine weighs in it too
    want_out = torch_ref.moe_combine_(out.double(), y, row_of_pair, weights.to(x.dtype).double())
    return want_act, act[live].double(), want_out
