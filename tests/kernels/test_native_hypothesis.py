"""Property tests: every native CPU kernel of kernels/cpu_native.py (and the sources it compiles)
against its torch reference, over drawn shapes (sizes off multiples of 8/16, size-1 edges), on
the SIMD and the portable paths. The GEMM and fused-block kernels: test_native_gemm_hypothesis.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.engine.models.deepseek_v4.moe import DENSE_ROWS_PER_CALL, MoE, RoutePlan
from deepinfer.engine.models.deepseek_v4.tiny_model import tiny_config
from deepinfer.kernels import cpu_native, torch_ref
from tests.conftest import load_test_helper

draws = load_test_helper("kernels/native_draws")
SETTINGS, FEW, seeds, paths, randn, rand = draws.SETTINGS, draws.FEW, draws.seeds, draws.paths, draws.randn, draws.rand

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler for the native kernels")
avx2_only = pytest.mark.skipif(not draws.has_avx2(), reason="the SIMD kernels need AVX2 + FMA")


@SETTINGS
@given(seed=seeds, outer=st.integers(1, 9), inner=st.integers(0, 4), d=st.integers(1, 70), pad=st.integers(0, 5),
       weighted=st.booleans(), eps=st.sampled_from((1e-6, 1e-2)))  # fmt: skip
def test_rms_norm(seed, outer, inner, d, pad, weighted, eps):
    shape = (outer, d) if inner == 0 else (outer, inner, d)
    base = randn(seed, *shape[:-1], d + pad, scale=3.0)
    x = base[..., :d]  # rows `pad` floats apart: the strided layouts the kernel reads in place
    weight = 1 + randn(seed + 1, d, scale=0.1) if weighted else None
    got = cpu_native.rms_norm(x, weight, eps)
    draws.close(got, torch_ref.rms_norm(x.contiguous(), weight, eps), atol=1e-6)


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 9), heads=st.integers(0, 5), pairs=st.integers(1, 12), extra=st.integers(0, 9))
def test_apply_rope(seed, rows, heads, pairs, extra):
    rd = 2 * pairs
    d = rd + extra
    shape = (rows, d) if heads == 0 else (rows, heads, d)
    x = randn(seed, *shape)
    cos, sin = draws.rope_tables(seed + 1, rows, rd)
    want = torch_ref.apply_rope_(x.clone(), cos, sin)
    got = x.clone()
    assert cpu_native.apply_rope_(got, cos, sin) is got
    draws.close(got, want, atol=1e-6)
    draws.close(cpu_native.apply_rope_(got, cos, -sin), x, atol=1e-5)  # the inverse undoes it


@SETTINGS
@given(seed=seeds, rows=st.integers(0, 9), m=st.integers(1, 40), limit=st.sampled_from((0.5, 3.0, 10.0)), path=paths)
def test_swiglu_clamped(seed, rows, m, limit, path):
    gate_up = randn(seed, rows, 2 * m, scale=8.0)  # well past the limit on both sides
    with draws.kernel_path(path):
        got = cpu_native.swiglu_clamped(gate_up, limit)
    draws.close(got, torch_ref.swiglu_clamped(gate_up, limit), atol=2e-6)
    if rows > 1:  # every row the same code wherever it sits
        with draws.kernel_path(path):
            assert torch.equal(cpu_native.swiglu_clamped(gate_up[1:2].contiguous(), limit), got[1:2])


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 9), e=st.integers(1, 40), k=st.integers(1, 8), hashed=st.booleans(),
       scoring=st.sampled_from(torch_ref.SCORING_FUNCS), scale=st.sampled_from((1.0, 1.5, 2.5)))  # fmt: skip
def test_moe_route(seed, rows, e, k, hashed, scoring, scale):
    k = min(k, e)
    logits = randn(seed, rows, e, scale=2.0)
    bias = randn(seed + 1, e, scale=0.2)
    g = torch.Generator().manual_seed(seed + 2)
    hash_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]) if hashed else None
    ids, weights = cpu_native.moe_route(logits, bias, hash_ids, k, scoring, scale)
    want_ids, want_w = torch_ref.moe_route(logits, bias, hash_ids, k, scoring, scale)
    assert torch.equal(ids, want_ids)
    draws.close(weights, want_w, atol=1e-6)


@SETTINGS
@given(seed=seeds, t=st.integers(0, 9), pad_rows=st.integers(0, 3), k=st.integers(1, 6), d=st.integers(1, 40),
       num_rows=st.integers(1, 30))  # fmt: skip
def test_moe_combine(seed, t, pad_rows, k, d, num_rows):
    out = randn(seed, t + pad_rows, d)
    rows = randn(seed + 1, num_rows, d)
    row_of_pair = torch.randint(0, num_rows, (t * k,), generator=torch.Generator().manual_seed(seed + 2))
    weights = rand(seed + 3, t, k)
    want = torch_ref.moe_combine_(out.clone(), rows, row_of_pair, weights)
    got = out.clone()
    assert cpu_native.moe_combine_(got, rows, row_of_pair, weights) is got
    draws.close(got, want, atol=2e-6)


def _python_dispatch(ids: torch.Tensor, num_experts: int, batch_invariant: bool):
    """The Python planner of MoE.dispatch (a MoE on the meta device: only its sizes matter)."""
    config = replace(tiny_config(), n_routed_experts=num_experts, num_experts_per_tok=ids.shape[1])
    moe = MoE(config, 1, device="meta")
    plan = RoutePlan(ids, torch.ones(ids.shape, dtype=torch.float32))
    saved = cpu_native.moe_dispatch
    cpu_native.moe_dispatch = lambda *a: None
    try:
        return moe.dispatch(plan, batch_invariant)
    finally:
        cpu_native.moe_dispatch = saved


@SETTINGS
@given(seed=seeds, t=st.integers(1, 70), e=st.integers(1, 20), k=st.integers(1, 6), bi=st.booleans(),
       never_dense=st.booleans())  # fmt: skip
def test_moe_dispatch(seed, t, e, k, bi, never_dense):
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k].sort().values for _ in range(t)])
    cost = -(1 << 40) if never_dense else DENSE_ROWS_PER_CALL
    token_of_row, row_of_pair, segments, rows_per_expert = cpu_native.moe_dispatch(ids, e, bi, cost)
    # the plan's contract, whichever layout it chose
    flat = ids.reshape(-1)
    assert torch.equal(token_of_row[row_of_pair], torch.arange(t * k) // k)
    owner = {r: ex for ex, first, end in segments for r in range(first, end)}
    assert [owner[int(r)] for r in row_of_pair] == flat.tolist()
    assert sorted(owner) == list(range(len(token_of_row)))
    if never_dense:
        assert rows_per_expert == 0 and [s[0] for s in segments] == sorted(set(flat.tolist()))
    if not never_dense:  # MoE.dispatch's layout choice (the staged CPU path plans with never_dense)
        want = _python_dispatch(ids, e, bi)
        assert torch.equal(token_of_row, want.token_of_row) and torch.equal(row_of_pair, want.row_of_pair)
        assert segments == [tuple(s) for s in want.segments] and rows_per_expert == want.rows_per_expert


def _attention_inputs(seed, g, h, d, window, num_extra, pool_rows_total, masked):
    """q, pool (last row zero: the sink), window rows (last = the sink slot), biases, extra keys."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(pool_rows_total + 1, d, generator=gen)
    pool[-1] = 0
    rows = torch.randint(0, pool_rows_total, (g, window + 1), generator=gen)
    rows[:, -1] = pool_rows_total
    valid = torch.rand(g, window + 1, generator=gen) >= masked
    valid[:, -1] = True
    bias = torch.where(valid, 0.0, float("-inf"))[:, None, :]
    extra = torch.randn(max(num_extra, 1) + 3, d, generator=gen)
    extra_rows = torch.randint(0, extra.shape[0], (g, num_extra), generator=gen)
    extra_bias = torch.where(torch.rand(g, num_extra, generator=gen) >= masked, 0.0, float("-inf"))[:, None, :]
    q = torch.randn(g, h, d, generator=gen)
    sinks = torch.randn(h, generator=gen)
    return q, pool, rows, bias, extra, extra_rows, extra_bias, sinks


attention_shapes = dict(
    seed=seeds, g=st.integers(1, 7), h=st.integers(1, 11), d=st.sampled_from((8, 16, 24, 40, 64)),
    window=st.integers(0, 12), num_extra=st.integers(0, 9), masked=st.sampled_from((0.0, 0.3, 1.0)),
)  # fmt: skip


@SETTINGS
@given(**attention_shapes, with_extra=st.booleans(), path=paths)
def test_gathered_attention(seed, g, h, d, window, num_extra, masked, with_extra, path):
    q, pool, rows, bias, extra, extra_rows, extra_bias, sinks = _attention_inputs(
        seed, g, h, d, window, num_extra, 20, masked
    )
    if not with_extra:
        extra = extra_rows = extra_bias = None
    args = (pool, rows, bias, extra, extra_rows, extra_bias, sinks, d**-0.5)
    last = (pool, rows[-1:], bias[-1:]) + ((None,) * 3 if extra is None else (extra, extra_rows[-1:], extra_bias[-1:]))
    with draws.kernel_path(path):
        got = cpu_native.gathered_attention(q, *args)
        alone = cpu_native.gathered_attention(q[-1:], *last, sinks, d**-0.5)
    draws.close(got, torch_ref.gathered_attention(q, *args), atol=3e-6)
    assert torch.equal(alone, got[-1:])  # a token's numbers depend on that token alone


@avx2_only
@SETTINGS
@given(**attention_shapes, ring_size=st.integers(1, 12), fresh=st.integers(1, 6), with_extra=st.booleans())
def test_window_attention_reads_the_pool_in_place(seed, g, h, d, window, num_extra, masked, ring_size, fresh,
                                                  with_extra):  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 7)
    ring = torch.randn(ring_size, d, generator=gen)
    ring_rows = torch.randint(0, ring_size, (int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen)
    fresh_rows = torch.randn(fresh, d, generator=gen)
    nr, nf = ring_rows.shape[0], fresh
    q, _, rows, bias, extra, extra_rows, extra_bias, sinks = _attention_inputs(seed, g, h, d, window, num_extra,
                                                                               nr + nf, masked)  # fmt: skip
    if not with_extra:
        extra = extra_rows = extra_bias = None
    got = cpu_native.window_attention(q, ring, ring_rows, fresh_rows, rows, bias, extra, extra_rows, extra_bias,
                                      sinks, d**-0.5)  # fmt: skip
    pool = torch.cat([ring[ring_rows], fresh_rows, torch.zeros(1, d)])
    want = torch_ref.gathered_attention(q, pool, rows, bias, extra, extra_rows, extra_bias, sinks, d**-0.5)
    draws.close(got, want, atol=3e-6)


@SETTINGS
@given(seed=seeds, ring_size=st.integers(1, 12), width=st.integers(1, 40), num_fresh=st.integers(1, 8),
       num_read=st.integers(0, 10), num_write=st.integers(0, 8), stride_pad=st.integers(0, 3))  # fmt: skip
def test_ring_write_and_window_pool(seed, ring_size, width, num_fresh, num_read, num_write, stride_pad):
    gen = torch.Generator().manual_seed(seed)
    ring = torch.randn(ring_size, width, generator=gen)
    fresh = torch.randn(num_fresh, width, generator=gen)
    ring_rows = torch.randint(0, ring_size, (num_read,), generator=gen)
    rows = torch.randperm(ring_size, generator=gen)[: min(num_write, ring_size)]  # distinct targets
    src = torch.randint(0, num_fresh, (rows.shape[0],), generator=gen)

    want_ring = ring.clone().index_copy_(0, rows, fresh[src])
    want_pool = torch.cat([ring[ring_rows], fresh, torch.zeros(1, width)])
    got_ring = ring.clone()
    pool = cpu_native.window_pool(got_ring, ring_rows, fresh, rows, src)
    assert torch.equal(pool, want_pool) and torch.equal(got_ring, want_ring)

    wide = torch.cat([fresh, torch.randn(num_fresh, stride_pad, generator=gen)], dim=1)[:, :width]  # strided rows
    got_ring = ring.clone()
    assert cpu_native.ring_write(got_ring, wide, rows, src)
    assert torch.equal(got_ring, want_ring)


@SETTINGS
@given(seed=seeds, rows=st.integers(0, 11), n=st.integers(1, 5), d=st.integers(1, 40))
def test_hc_post(seed, rows, n, d):
    streams, out = randn(seed, rows, n, d), randn(seed + 1, rows, d)
    post, comb = rand(seed + 2, rows, n) * 2, rand(seed + 3, rows, n, n)
    got = cpu_native.hc_post(out, streams, post, comb)
    draws.close(got, torch_ref.hc_post(out, streams, post, comb), atol=2e-6)


def mhc_weights(seed: int, n: int, d: int):
    fn = randn(seed, (2 + n) * n, n * d, scale=(n * d) ** -0.5)
    scale, base = 1 + randn(seed + 1, 2 * n, scale=0.2), randn(seed + 2, 2 * n, scale=0.2)
    return fn, scale, base, 1 + 0.2 * float(randn(seed + 3, 1)), randn(seed + 4, n, n, scale=0.2)


@SETTINGS
@given(seed=seeds, t=st.integers(0, 20), n=st.integers(1, 5), d=st.integers(1, 24), iters=st.sampled_from((1, 2, 20)),
       bi=st.booleans(), path=paths)  # fmt: skip
def test_hc_pre(seed, t, n, d, iters, bi, path):
    """mHC weights: the fused call (norm + GEMM + Sinkhorn 8 rows at a time) on AVX2, the
    separate native norm / torch GEMM / scalar Sinkhorn on the portable path."""
    streams = randn(seed + 9, t, n, d, scale=2.0)
    fn, scale, base, comb_scale, comb_base = mhc_weights(seed, n, d)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters, batch_invariant=bi)
    with draws.kernel_path(path):
        got = cpu_native.hc_pre(streams, fn, scale, base, comb_scale, comb_base, **kw)
    want = torch_ref.hc_pre(streams, fn, scale, base, comb_scale, comb_base, **kw)
    for a, b in zip(got, want):
        draws.close(a, b, atol=1e-5)


@FEW
@given(seed=seeds, t=st.integers(1, 12), n=st.integers(1, 6), iters=st.integers(1, 25))
def test_sinkhorn_numpy_loop_is_the_torch_formula(seed, t, n, iters):
    comb = rand(seed, t, n, n) + 1e-6
    want = comb.double() / (comb.double().sum(dim=-2, keepdim=True) + 1e-6)
    for _ in range(iters - 1):
        want = want / (want.sum(dim=-1, keepdim=True) + 1e-6)
        want = want / (want.sum(dim=-2, keepdim=True) + 1e-6)
    got = torch_ref.sinkhorn(comb.clone(), iters, 1e-6)  # float32 on CPU: the numpy loop, in place
    draws.close(got, want.float(), atol=1e-6)
