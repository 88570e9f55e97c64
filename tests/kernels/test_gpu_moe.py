"""Triton MoE kernels (kernels/gpu_moe.py) against torch_ref: routing (three scoring functions,
hash routing), the routed experts over any number of tokens / experts / slots and sizes off the
tiles, combine and SwiGLU; poisoned outputs and scratch buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_moe  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@cases.examples()
@given(t=st.integers(1, 80), e=st.sampled_from([2, 9, 64, 300]), k=st.sampled_from([1, 2, 6, 8]),
       scoring=st.sampled_from(list(gpu_moe.SCORING)),
       hashed=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_moe_route(t, e, k, scoring, hashed, dtype, seed):
    k = min(k, e)
    g = cases.gen(seed)
    logits = cases.randn(t, e, dtype=dtype, gen=g, scale=2.0)
    bias = 0.2 * cases.randn(e, gen=g)
    hash_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(cases.DEVICE) if hashed else None
    with cases.poisoned_allocations():
        ids, weights = gpu_moe.moe_route(logits, None if hashed else bias, hash_ids, k, scoring, 1.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, ids.sort(dim=-1).values)
    # the weights of the picked experts follow the reference formula (the hash path takes the given ids;
    # bf16 scores may round one ulp apart: softplus is computed by another formula)
    want_ids, want_w = torch_ref.moe_route(logits, None, ids, k, scoring, 1.5)
    bound = 1e-5 if dtype == torch.float32 else cases.BF16_TOL
    assert torch.equal(want_ids, ids) and cases.rel_err(weights, want_w) < bound
    if hashed:
        assert torch.equal(ids, hash_ids.sort(dim=-1).values)
        return
    # the picks are a top-k of score + bias: no expert left out beats one picked (bf16 scores tie often)
    ref_ids, _ = torch_ref.moe_route(logits, bias, None, k, scoring, 1.5)
    scores = {"sqrtsoftplus": lambda x: torch_ref.softplus(x).sqrt(), "sigmoid": torch_ref.sigmoid,
              "softmax": lambda x: x.softmax(dim=-1)}[scoring](logits)  # torch_ref.moe_route's scores
    if dtype == torch.float32 or cases.HAS_CUDA:
        ranked = scores + bias
        picked = ranked.gather(1, ids).min(dim=1).values
        left = ranked.masked_fill(torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ids, True), float("-inf"))
        assert (left.max(dim=1).values <= picked + (1e-6 if dtype == torch.float32 else 1e-2)).all()
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)


@cases.examples()
@given(t=st.integers(1, 70), e=st.sampled_from([1, 7, 64]), k=st.sampled_from([1, 2, 6]),
       h=st.sampled_from([1, 40, 300]), i=st.sampled_from([3, 64, 200]), extra_rows=st.integers(0, 5), dtype=DTYPES,
       seed=st.integers(0, 2**31))
def test_moe_experts(t, e, k, h, i, extra_rows, dtype, seed):
    k = min(k, e)
    g = cases.gen(seed)
    x = cases.randn(t + extra_rows, h, dtype=dtype, gen=g)
    gate_up = cases.randn(e, 2 * i, h, dtype=dtype, gen=g, scale=h**-0.5)
    down = cases.randn(e, h, i, dtype=dtype, gen=g, scale=i**-0.5)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(dim=-1).values.to(cases.DEVICE)
    weights = torch.rand(t, k, generator=g).to(cases.DEVICE)
    out = cases.randn(t + extra_rows, h, dtype=dtype, gen=g)
    with cases.poisoned_allocations():
        got = gpu_moe.moe_experts_(out.clone(), x, ids, weights, gate_up, down, 1.5)
    want = torch_ref.moe_experts_(out.double(), x.double(), ids, weights.double(), gate_up.double(), down.double(), 1.5)
    assert cases.rel_err(got[:t], want[:t]) < cases.tol(dtype)
    assert torch.equal(got[t:], out[t:])  # padding rows: untouched


@cases.examples()
@given(t=st.integers(1, 160), e=st.sampled_from([1, 7, 64, 300]), k=st.sampled_from([1, 2, 6]),
       bm=st.sampled_from([16, 128]), chunk=st.integers(1, 400), skew=st.booleans(), seed=st.integers(0, 2**31))
def test_moe_align_in_chunks(t, e, k, bm, chunk, skew, seed):
    """The layout built in parallel chunks (any chunk size, off the kernels' tiles) equals the one
    program's, and both are right: each pair's row holds its token in a block of its expert, an
    expert's pairs take its rows in ascending order from a segment start that is a block start,
    padding rows of used blocks hold the sentinel t, unused blocks are -1."""
    k = min(k, e)
    g = cases.gen(seed)
    probs = torch.tensor([20.0] * min(3, e) + [1.0] * (e - min(3, e))) if skew else torch.ones(e)
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(t)]).sort(dim=-1).values
    with cases.poisoned_allocations():
        one = gpu_moe.moe_align(ids.to(cases.DEVICE), e, bm, chunk_pairs=t * k)
        many = gpu_moe.moe_align(ids.to(cases.DEVICE), e, bm, chunk_pairs=chunk)
    tok, rop, bexp = (x.cpu() for x in many)
    assert torch.equal(bexp, one[2].cpu()) and torch.equal(rop, one[1].cpu())
    used_rows = (bexp >= 0).repeat_interleave(bm)
    assert torch.equal(tok[used_rows], one[0].cpu()[used_rows])
    flat = ids.reshape(-1)
    pair = torch.arange(t * k)
    assert torch.equal(tok[rop].long(), pair // k) and torch.equal(bexp[rop // bm].long(), flat)
    real = torch.zeros_like(tok, dtype=torch.bool)
    real[rop] = True
    assert torch.equal(tok[used_rows & ~real], torch.full_like(tok[used_rows & ~real], t))
    for x in flat.unique().tolist():
        rows = rop[flat == x]
        assert int(rows[0]) % bm == 0 and torch.equal(rows, rows[0] + torch.arange(len(rows)))
    assert bexp.numel() * bm == tok.numel() and int((bexp >= 0).sum()) == sum(
        -(-int((flat == x).sum()) // bm) for x in flat.unique().tolist())


@cases.examples()
@given(t=st.integers(257, 700), e=st.sampled_from([5, 16]), h=st.sampled_from([96, 100, 264]),
       i=st.sampled_from([36, 80, 72]), grouped=st.booleans(), seed=st.integers(0, 2**31))
def test_moe_experts_prefill_tiles(t, e, h, i, grouped, seed):
    """Enough pairs for the prefill layout (128-row blocks), skewed towards a few experts, through
    the Triton tiles or torch's grouped GEMM (bf16 with widths a multiple of 8; other widths fall
    back to the tiles)."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(gpu_moe, "GROUPED_MM", grouped and hasattr(torch, "_grouped_mm"))
    try:
        _prefill_case(t, e, h, i, seed, monkeypatch)
    finally:
        monkeypatch.undo()


def _prefill_case(t, e, h, i, seed, monkeypatch):
    g = cases.gen(seed)
    k = 4
    x = cases.randn(t, h, dtype=torch.bfloat16, gen=g)
    gate_up = cases.randn(e, 2 * i, h, dtype=torch.bfloat16, gen=g, scale=h**-0.5)
    down = cases.randn(e, h, i, dtype=torch.bfloat16, gen=g, scale=i**-0.5)
    probs = torch.tensor([8.0] * 3 + [1.0] * (e - 3))
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(t)]).sort(dim=-1).values.to(cases.DEVICE)
    weights = torch.rand(t, k, generator=g).to(cases.DEVICE)
    out = torch.zeros(t, h, dtype=torch.bfloat16, device=cases.DEVICE)
    # over 1,000 pairs: the align in chunks of 1,000 as past 8K pairs in serving
    monkeypatch.setattr(gpu_moe, "ALIGN_CHUNK_PAIRS", 1000)
    with cases.poisoned_allocations():
        got = gpu_moe.moe_experts_(out, x, ids, weights, gate_up, down, 10.0)
    want = torch_ref.moe_experts_(torch.zeros(t, h, dtype=torch.float64, device=cases.DEVICE), x.double(), ids,
                                  weights.double(), gate_up.double(), down.double(), 10.0)  # fmt: skip
    assert cases.rel_err(got, want) < cases.BF16_TOL


@cases.examples()
@given(t=st.integers(1, 50), k=st.sampled_from([1, 6]), h=st.sampled_from([1, 100, 3000]), rows=st.integers(1, 60),
       dtype=DTYPES, seed=st.integers(0, 2**31))
def test_combine_and_swiglu(t, k, h, rows, dtype, seed):
    g = cases.gen(seed)
    out = cases.randn(t + 2, h, dtype=dtype, gen=g)
    expert_rows = cases.randn(rows, h, dtype=dtype, gen=g)
    row_of_pair = torch.randint(0, rows, (t * k,), generator=g).to(cases.DEVICE)
    weights = torch.rand(t, k, generator=g).to(cases.DEVICE)
    got = gpu_moe.moe_combine_(out.clone(), expert_rows, row_of_pair, weights)
    # the reference weighs in the rows' dtype
    want = torch_ref.moe_combine_(out.double(), expert_rows.double(), row_of_pair, weights.to(dtype).double())
    assert cases.rel_err(got, want) < cases.tol(dtype) and torch.equal(got[t:], out[t:])
    gate_up = cases.randn(rows, 2 * h, dtype=dtype, gen=g, scale=4.0)
    with cases.poisoned_allocations():
        got = gpu_moe.swiglu_clamped(gate_up, 3.0)
    assert cases.rel_err(got, torch_ref.swiglu_clamped(gate_up.double(), 3.0)) < cases.tol(dtype)
