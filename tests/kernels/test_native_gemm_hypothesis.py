"""Property tests: the fixed-order GEMMs and the fused native blocks of kernels/cpu_gemm.py
(cpu_gemm_src.py, cpu_moe_src.py) against torch formulas, over drawn shapes: widths off the
16-column panel (half and ragged last panels), size-1 edges, both native code paths.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kernels import cpu_gemm, torch_ref
from tests.conftest import load_test_helper

draws = load_test_helper("kernels/native_draws")
SETTINGS, seeds, paths, randn, rand = draws.SETTINGS, draws.seeds, draws.paths, draws.randn, draws.rand

pytestmark = pytest.mark.skipif(not draws.has_avx2(), reason="the native GEMMs serve CPUs with AVX2 + FMA")


@SETTINGS
@given(seed=seeds, m=st.integers(0, 60), n=st.integers(1, 50), k=st.integers(1, 70), pad=st.integers(0, 3),
       path=paths)  # fmt: skip
def test_linear(seed, m, n, k, pad, path):
    x = randn(seed, m, k + pad)[:, :k]  # rows `pad` floats apart
    w = randn(seed + 1, n, k)
    with draws.kernel_path(path, wrappers=False):  # portable: the scalar FMA chains of the same entry point
        got = cpu_gemm.linear(x, w)
        alone = cpu_gemm.linear(x[m // 2 : m // 2 + 1], w)
    draws.gemm_close(got, x, w)
    assert torch.equal(alone, got[m // 2 : m // 2 + 1])  # a row's numbers depend on that row alone
    if path == "portable":
        assert torch.equal(got, cpu_gemm.linear(x, w))  # bitwise the AVX2 numbers


@SETTINGS
@given(seed=seeds, m=st.integers(0, 13), g=st.integers(1, 5), n=st.integers(1, 40), k=st.integers(1, 40))
def test_grouped_linear(seed, m, g, n, k):
    assert cpu_gemm.packed_size(n, k) == cpu_gemm._library().gemm_packed_size(n, k)  # one layout on both sides
    x, w = randn(seed, m, g, k), randn(seed + 1, g, n, k)
    got = cpu_gemm.grouped_linear(x, w)
    assert got.shape == (m, g, n)
    for j in range(g):
        draws.gemm_close(got[:, j], x[:, j], w[j])


@SETTINGS
@given(seed=seeds, e=st.integers(1, 6), h=st.integers(1, 40), inter=st.integers(1, 24), t=st.integers(1, 12),
       num_seg=st.integers(1, 6), limit=st.sampled_from((1.0, 10.0)), path=paths)  # fmt: skip
def test_moe_experts(seed, e, h, inter, t, num_seg, limit, path):
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = randn(seed, e, 2 * inter, h, scale=h**-0.5), randn(seed + 1, e, h, inter, scale=inter**-0.5)
    x = randn(seed + 2, t, h, scale=3.0)
    sizes = torch.randint(1, 6, (num_seg,), generator=gen).tolist()
    experts = torch.randint(0, e, (num_seg,), generator=gen).tolist()
    firsts = [sum(sizes[:i]) for i in range(num_seg)]
    segments = [(ex, f, f + s) for ex, f, s in zip(experts, firsts, sizes)]
    token_of_row = torch.randint(0, t, (sum(sizes),), generator=gen)
    with draws.kernel_path(path, wrappers=False):
        got = cpu_gemm.moe_experts(x, token_of_row, segments, gate_up, down, limit)
    for ex, first, end in segments:
        act = torch_ref.swiglu_clamped(x[token_of_row[first:end]] @ gate_up[ex].t(), limit)
        draws.close(got[first:end], act @ down[ex].t(), atol=1e-4, rtol=1e-4)


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 12), pad=st.integers(0, 3), h=st.integers(1, 32), e=st.integers(1, 12),
       k=st.integers(1, 4), inter=st.integers(1, 20), shared_inter=st.integers(1, 20), hashed=st.booleans(),
       scoring=st.sampled_from(torch_ref.SCORING_FUNCS), path=paths)  # fmt: skip
def test_moe_forward(seed, rows, pad, h, e, k, inter, shared_inter, hashed, scoring, path):
    """The whole MoE block in one call: shared expert on every row, routed experts on the first
    ``rows - pad`` (learned top-k with bias or a hash table), weighted sum in expert order."""
    k, t, vocab = min(k, e), max(rows - pad, 0), 50
    gen = torch.Generator().manual_seed(seed)
    x = randn(seed, rows, h)
    router = randn(seed + 1, e, h, scale=h**-0.5 * 2)
    bias = randn(seed + 2, e, scale=0.2)
    tid2eid = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(vocab)]) if hashed else None
    token_ids = torch.randint(0, vocab, (rows,), generator=gen)
    gate_up, down = randn(seed + 3, e, 2 * inter, h, scale=h**-0.5), randn(seed + 4, e, h, inter, scale=inter**-0.5)
    shared_gu, shared_down = randn(seed + 5, 2 * shared_inter, h, scale=h**-0.5), randn(seed + 6, h, shared_inter)
    limit, scale = 3.0, 1.5
    with draws.kernel_path(path, wrappers=False):
        got = cpu_gemm.moe_forward(x, t, router, None if hashed else bias, tid2eid, token_ids, k, scoring, scale,
                                   gate_up, down, limit, shared_gu, shared_down)  # fmt: skip
    x64 = x.double()
    want = torch_ref.swiglu_clamped(x64 @ shared_gu.double().t(), limit) @ shared_down.double().t()
    ids, weights = torch_ref.moe_route((x64[:t] @ router.double().t()).float(), None if hashed else bias,
                                       tid2eid[token_ids[:t]] if hashed else None, k, scoring, scale)  # fmt: skip
    for r in range(t):
        for j in range(k):
            ex = int(ids[r, j])
            act = torch_ref.swiglu_clamped(x64[r] @ gate_up[ex].double().t(), limit)
            want[r] += weights[r, j].double() * (act @ down[ex].double().t())
    draws.close(got, want.float(), atol=1e-4, rtol=1e-4)


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 12), n=st.integers(1, 5), d=st.integers(1, 24), with_block=st.booleans(),
       iters=st.sampled_from((1, 20)), path=paths)  # fmt: skip
def test_hc_post_pre(seed, rows, n, d, with_block, iters, path):
    """New streams, the next block's mHC weights and its normed input in one call."""
    streams = randn(seed, rows, n, d)
    block_out = randn(seed + 1, rows, d) if with_block else None
    post, comb = rand(seed + 2, rows, n) * 2, rand(seed + 3, rows, n, n)
    fn = randn(seed + 4, (2 + n) * n, n * d, scale=(n * d) ** -0.5)
    hc = SimpleNamespace(  # a finalized HyperConnection's fields
        fn=fn, pre_post_scale=1 + randn(seed + 5, 2 * n, scale=0.2), pre_post_base=randn(seed + 6, 2 * n, scale=0.2),
        comb_scale=1.2, comb_base=randn(seed + 7, n, n, scale=0.2), sinkhorn_iters=iters, norm_eps=1e-6, hc_eps=1e-6,
    )
    norm_weight = 1 + randn(seed + 8, d, scale=0.1)
    with draws.kernel_path(path, wrappers=False):
        got = cpu_gemm.hc_post_pre(block_out, streams, post if with_block else None, comb if with_block else None,
                                   hc, norm_weight, 1e-6)  # fmt: skip
    new_streams = torch_ref.hc_post(block_out, streams, post, comb) if with_block else streams
    w_post, w_comb, collapsed = torch_ref.hc_pre(
        new_streams, fn, hc.pre_post_scale, hc.pre_post_base, hc.comb_scale, hc.comb_base,
        norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters,
    )  # fmt: skip
    want = (new_streams, w_post, w_comb, torch_ref.rms_norm(collapsed, norm_weight, 1e-6))
    for a, b in zip(got, want):
        draws.close(a, b, atol=2e-5)


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 9), hidden=st.integers(1, 40), q_rank=st.integers(1, 24),
       nh=st.integers(1, 5), hd=st.integers(2, 24), rd_pairs=st.integers(1, 6), ih=st.integers(0, 4),
       ihd=st.integers(2, 20), more=st.integers(0, 9), path=paths)  # fmt: skip
def test_attention_inputs(seed, rows, hidden, q_rank, nh, hd, rd_pairs, ih, ihd, more, path):
    """(proj, q_all, q, kv) of a V4 attention layer: q_a | kv | compressor columns from one GEMM,
    q_b (attention heads | indexer heads) from the normed q_a, norms and rotations."""
    rd = min(2 * rd_pairs, hd - hd % 2, ihd - ihd % 2 if ih else hd)  # >= 2: hd, ihd >= 2
    n_in, n_qb = q_rank + hd + more, nh * hd + ih * ihd
    h = randn(seed, rows, hidden)
    w_in, w_qb = randn(seed + 1, n_in, hidden, scale=hidden**-0.5), randn(seed + 2, n_qb, q_rank, scale=q_rank**-0.5)
    q_norm, kv_norm = 1 + randn(seed + 3, q_rank, scale=0.1), 1 + randn(seed + 4, hd, scale=0.1)
    cos, sin = draws.rope_tables(seed + 5, rows, rd)
    icos, isin = draws.rope_tables(seed + 6, rows, rd)
    index = (ih, ihd, icos, isin) if ih else ()
    with draws.kernel_path(path, wrappers=False):
        got = cpu_gemm.attention_inputs(h, w_in, q_rank, q_norm, w_qb, kv_norm, 1e-6, nh, hd, cos, sin, *index)

    proj = h @ w_in.t()
    q_all = torch_ref.rms_norm(proj[:, :q_rank], q_norm, 1e-6) @ w_qb.t()
    q = torch_ref.apply_rope_(torch_ref.rms_norm(q_all[:, : nh * hd].reshape(rows, nh, hd), None, 1e-6), cos, sin)
    kv = torch_ref.apply_rope_(torch_ref.rms_norm(proj[:, q_rank : q_rank + hd], kv_norm, 1e-6), cos, sin)
    if ih:
        torch_ref.apply_rope_(q_all[:, nh * hd :].view(rows, ih, ihd), icos, isin)
    for a, b in zip(got, (proj, q_all, q, kv)):
        draws.close(a, b, atol=3e-5, rtol=3e-5)


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 9), nh=st.integers(1, 8), hd=st.integers(2, 24), groups=st.integers(1, 8),
       rank=st.integers(1, 40), hidden=st.integers(1, 40), rd_pairs=st.integers(1, 6), path=paths)  # fmt: skip
def test_attention_outputs(seed, rows, nh, hd, groups, rank, hidden, rd_pairs, path):
    """``o_b(grouped o_a(unrotate(out)))``: per group the rank columns off the 16-column panel
    are where a wrong panel stride of the grouped weights reads another group's weights."""
    if (nh * hd) % groups:
        groups = 1
    rd = min(2 * rd_pairs, hd - hd % 2)
    out = randn(seed, rows, nh, hd)
    cos, sin = draws.rope_tables(seed + 1, rows, rd)
    w_oa = randn(seed + 2, groups, rank, nh * hd // groups, scale=(nh * hd / groups) ** -0.5)
    w_ob = randn(seed + 3, hidden, groups * rank, scale=(groups * rank) ** -0.5)
    unrotated = torch_ref.apply_rope_(out.clone(), cos, -sin)
    mixed = torch.einsum("rgk,gnk->rgn", unrotated.view(rows, groups, -1).double(), w_oa.double())
    want = mixed.reshape(rows, -1) @ w_ob.double().t()
    got_out = out.clone()
    with draws.kernel_path(path, wrappers=False):
        got = cpu_gemm.attention_outputs(got_out, cos, -sin, w_oa, w_ob)
    draws.close(got_out, unrotated, atol=1e-6)  # un-rotated in place
    draws.close(got, want.float(), atol=1e-4, rtol=1e-4)
