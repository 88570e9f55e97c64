"""Torch reference ops: math against naive formulas, and the batch-invariance contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import cpu_gemm, cpu_native, ops, torch_ref


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k, n", [(64, 48), (256, 1024), (32, 384), (128, 8)])
def test_linear_rows_do_not_depend_on_the_other_rows(k, n):
    g = gen(1)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
    full = ops.linear(x, w, batch_invariant=True)
    for m in [1, 2, 3, 5, 7, 9, 11, 12, 16, 17, 33, 100]:
        for off in [0, 1, 29]:
            got = ops.linear(x[off : off + m], w, batch_invariant=True)
            assert torch.equal(got, full[off : off + m]), (m, off)
    strided = torch.randn(300, 2 * k, generator=g)[:, :k]  # a column slice, as after a fused GEMM
    assert torch.equal(ops.linear(strided[5:6], w, True), ops.linear(strided, w, True)[5:6])
    assert torch.allclose(full, x @ w.T, atol=1e-4)


def test_grouped_linear_and_bmm_are_invariant():
    g = gen(2)
    x, w = torch.randn(120, 4, 32, generator=g), torch.randn(4, 16, 32, generator=g)
    full = ops.grouped_linear(x, w, True)
    assert torch.allclose(full, torch.einsum("mgk,gnk->mgn", x, w), atol=1e-5)
    for m in [1, 3, 15, 40]:
        assert torch.equal(ops.grouped_linear(x[7 : 7 + m], w, True), full[7 : 7 + m])
    a, b = torch.randn(50, 4, 32, generator=g), torch.randn(50, 4, 32, generator=g)
    bt = b.transpose(1, 2)  # strided operand, as for q @ k^T
    ref = ops.bmm(a, bt, True)
    for lo, hi in [(0, 1), (3, 4), (5, 12), (0, 50)]:
        assert torch.equal(ops.bmm(a[lo:hi], bt[lo:hi], True), ref[lo:hi])


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_transcendental_ops_give_each_element_the_same_value_anywhere(name):
    fn = getattr(ops, name)
    x = torch.randn(1000, 6, generator=gen(3))
    full = fn(x, True)
    reference = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}[name]
    assert torch.allclose(full, reference(x), atol=1e-6)
    for lo, hi in [(0, 1), (1, 2), (999, 1000), (13, 40), (500, 1000)]:
        assert torch.equal(fn(x[lo:hi], True), full[lo:hi])


def test_rope_matches_complex_rotation_and_inverts():
    g = gen(4)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = ops.rope_tables(positions, inv_freq)
    x = torch.randn(5, 3, 24, generator=g)
    y = torch_ref.apply_rope_(x.clone(), cos, sin)
    assert torch.equal(y[..., :16], x[..., :16])  # the leading channels are not rotated
    z = torch.view_as_complex(x[..., 16:].double().reshape(5, 3, 4, 2).contiguous())
    angle = positions[:, None, None].double() * inv_freq.double()
    expected = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(5, 3, 8)
    assert torch.allclose(y[..., 16:].double(), expected, atol=1e-4)
    assert torch.allclose(torch_ref.apply_rope_(y.clone(), cos, -sin), x, atol=1e-5)
    single = ops.rope_tables(positions[3:4], inv_freq)
    assert torch.equal(single[0], cos[3:4]) and torch.equal(single[1], sin[3:4])
    native = cpu_native.apply_rope_(x.clone(), cos, sin)
    assert torch.equal(native, y)  # same float32 rounding sequence
    strided = torch.randn(5, 40, generator=g)[:, 8:32].view(5, 3, 8)  # rows of a column slice
    assert torch.equal(cpu_native.apply_rope_(strided.clone(), cos[:, :8].contiguous(), sin[:, :8].contiguous()),
                       torch_ref.apply_rope_(strided.clone(), cos[:, :8], sin[:, :8]))  # fmt: skip


def naive_attention(q, keys, bias, sinks, sink_slot, scale):
    k = keys.double()
    logits = torch.einsum("ghd,gnd->ghn", q.double(), k) * scale + bias.double()
    logits[:, :, sink_slot] = sinks.double()
    p = torch.softmax(logits, -1)
    p[:, :, sink_slot] = 0
    return torch.einsum("ghn,gnd->ghd", p, k)


def test_attention_with_sink_matches_naive_and_is_invariant():
    g = gen(5)
    q = torch.randn(20, 4, 32, generator=g)
    keys = torch.randn(20, 23, 32, generator=g)
    keys[:, 16] = 0  # the sink slot between the window rows and the compressed entries
    bias = torch.zeros(20, 1, 23)
    bias[:5, :, :10] = -math.inf  # early tokens see fewer window rows
    bias[:, :, 21:] = -math.inf  # two compressed entries not closed yet
    sinks = torch.randn(4, generator=g)
    out = ops.attention_with_sink(q, keys, bias, sinks, 16, 32**-0.5, True)
    assert torch.allclose(out.double(), naive_attention(q, keys, bias, sinks, 16, 32**-0.5), atol=1e-5)
    for lo, hi in [(0, 1), (4, 5), (3, 11)]:
        part = ops.attention_with_sink(q[lo:hi], keys[lo:hi], bias[lo:hi], sinks, 16, 32**-0.5, True)
        assert torch.equal(part, out[lo:hi])
    # a huge sink logit takes all the mass: the output goes to zero
    assert ops.attention_with_sink(q, keys, bias, torch.full((4,), 1e4), 16, 0.1, True).abs().max() < 1e-6


def test_sinkhorn_numpy_path_equals_torch_and_is_doubly_stochastic():
    c = torch.softmax(torch.randn(30, 4, 4, generator=gen(6)), -1) + 1e-6
    fast = ops.sinkhorn(c.clone(), 20, 1e-6)
    slow = c.clone()
    slow = slow / (slow.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        slow = slow / (slow.sum(-1, keepdim=True) + 1e-6)
        slow = slow / (slow.sum(-2, keepdim=True) + 1e-6)
    assert torch.equal(fast, slow)
    assert torch.allclose(fast.sum(-1), torch.ones(30, 4), atol=1e-3)
    assert torch.allclose(fast.sum(-2), torch.ones(30, 4), atol=1e-5)


def hc_inputs(n=4, d=32, rows=40):
    g = gen(7)
    streams = torch.randn(rows, n, d, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=g), 1 + 0.1 * torch.randn(3, generator=g)
    weights = (fn, torch.cat([scale[0].expand(n), scale[1].expand(n)]), base[: 2 * n], scale[2], base[2 * n :].view(n, n))
    return streams, weights


@pytest.mark.parametrize("impl", [torch_ref.hc_pre, cpu_native.hc_pre])
def test_hc_pre_rows_are_invariant(impl):
    streams, weights = hc_inputs()
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, batch_invariant=True)
    full = impl(streams, *weights, **kw)
    for lo, hi in [(0, 1), (39, 40), (5, 22)]:
        part = impl(streams[lo:hi], *weights, **kw)
        assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part, full))
    post, comb, collapsed = full
    assert post.shape == (40, 4) and comb.shape == (40, 4, 4) and collapsed.shape == (40, 32)
    assert torch.all(post > 0) and torch.all(post < 2)


def test_native_kernels_match_the_reference():
    if cpu_native.library() is None:
        pytest.skip("no C compiler: the reference runs instead")
    streams, weights = hc_inputs(n=3, d=48)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, batch_invariant=True)
    for a, b in zip(cpu_native.hc_pre(streams, *weights, **kw), torch_ref.hc_pre(streams, *weights, **kw)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    g = gen(9)
    x, w = torch.randn(7, 3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    assert torch.allclose(cpu_native.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6), atol=1e-6)
    strided = torch.randn(7, 100, generator=g)[:, 10:74]
    assert torch.allclose(cpu_native.rms_norm(strided, None, 1e-6), torch_ref.rms_norm(strided, None, 1e-6), atol=1e-6)
    gu = torch.randn(9, 16, generator=g) * 20
    assert torch.allclose(cpu_native.swiglu_clamped(gu, 10.0), torch_ref.swiglu_clamped(gu, 10.0), atol=1e-5)
    big = torch.randn(300, 16, generator=g)
    full = cpu_native.swiglu_clamped(big, 10.0)
    assert torch.equal(cpu_native.swiglu_clamped(big[7:8], 10.0), full[7:8])


def test_native_kernels_fall_back_when_disabled():
    streams, weights = hc_inputs(n=2, d=16, rows=3)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, batch_invariant=True)
    try:
        cpu_native.set_enabled(False)
        assert cpu_native.library() is None
        got = cpu_native.hc_pre(streams, *weights, **kw)
    finally:
        cpu_native.set_enabled(True)
    assert all(torch.equal(a, b) for a, b in zip(got, torch_ref.hc_pre(streams, *weights, **kw)))
    double = streams.double()  # not float32: the reference runs
    assert cpu_native.rms_norm(double, None, 1e-6).dtype == torch.float64


def test_moe_dense_and_per_expert_gemms_give_the_same_rows():
    g = gen(10)
    w = torch.randn(6, 32, 48, generator=g)
    rows = torch.randn(6, 8, 48, generator=g)
    dense = torch.bmm(rows, w.transpose(1, 2))
    for e in range(6):
        for count in [1, 3, 5, 8]:
            padded = torch_ref.gemm_rows(count)
            x = torch.cat([rows[e, :count], torch.zeros(padded - count, 48)])
            assert torch.equal(torch.mm(x, w[e].t())[:count], dense[e, :count])


def test_rms_norm_and_swiglu_formulas():
    g = gen(8)
    x, w = torch.randn(6, 16, generator=g), torch.rand(16, generator=g) + 0.5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), expected, atol=1e-6)
    assert torch.allclose(ops.rms_norm(x, None, 1e-6), expected / w, atol=1e-5)
    reference = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(torch_ref.rms_norm(x, w, 1e-6), (w * reference).to(x.dtype))  # transformers' rounding
    gu = torch.randn(6, 8, generator=g) * 20
    gate, up = gu[:, :4], gu[:, 4:]
    expected = F.silu(gate.clamp(max=10)) * up.clamp(-10, 10)
    assert torch.allclose(ops.swiglu_clamped(gu, 10.0, True), expected, atol=1e-6)


def test_register_routes_an_op_and_reset_restores_it():
    calls = []

    def fake_linear(x, w, batch_invariant=False):
        calls.append(x.shape)
        return torch_ref.linear(x, w, batch_invariant)

    try:
        ops.register("linear", fake_linear)
        assert ops.backend_of("linear") != "torch_ref"
        ops.linear(torch.ones(2, 3), torch.ones(4, 3))
        assert calls == [torch.Size([2, 3])]
        with pytest.raises(KeyError, match="unknown op"):
            ops.register("no_such_op", fake_linear)
    finally:
        ops.reset()
    assert ops.linear is cpu_gemm.linear and ops.hc_pre is cpu_native.hc_pre  # the default routing is back
    assert ops.backend_of("sinkhorn") == "torch_ref"
    try:
        ops.use_reference()
        assert ops.hc_pre is torch_ref.hc_pre
    finally:
        ops.reset()


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_moe_route_native_matches_reference(scoring):
    g = gen(11)
    logits, bias = torch.randn(37, 16, generator=g), 0.2 * torch.randn(16, generator=g)
    ids, weights = torch_ref.moe_route(logits, bias, None, 4, scoring, 1.5, True)
    assert torch.all(ids[:, 1:] > ids[:, :-1])  # ascending, distinct
    assert torch.allclose(weights.sum(-1), torch.full((37,), 1.5), atol=1e-5)
    hashed = torch.randint(0, 16, (37, 4), generator=g).sort(-1).values
    hid, _ = torch_ref.moe_route(logits, None, hashed, 4, scoring, 1.5, True)
    assert torch.equal(hid, hashed)
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    nid, nweights = cpu_native.moe_route(logits, bias, None, 4, scoring, 1.5, True)
    assert torch.equal(nid, ids) and torch.allclose(nweights, weights, atol=1e-6)
    part = cpu_native.moe_route(logits[5:6], bias, None, 4, scoring, 1.5, True)
    assert torch.equal(part[0], nid[5:6]) and torch.equal(part[1], nweights[5:6])


def test_moe_combine_native_matches_reference():
    g = gen(12)
    rows, weights = torch.randn(40, 24, generator=g), torch.rand(6, 3, generator=g)
    row_of_pair = torch.randperm(40, generator=g)[:18]
    base = torch.randn(8, 24, generator=g)
    expected = torch_ref.moe_combine_(base.clone(), rows, row_of_pair, weights)
    assert torch.equal(expected[6:], base[6:])  # rows past the tokens are untouched
    got = cpu_native.moe_combine_(base.clone(), rows, row_of_pair, weights)
    assert torch.allclose(got, expected, atol=1e-5)
