"""Torch reference ops: math against naive formulas, and the batch-invariance contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import ops, torch_ref


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
    cos, sin = ops.rope_cos_sin(positions, inv_freq)
    x = torch.randn(5, 3, 24, generator=g)
    y = ops.apply_rope(x, cos, sin)
    assert torch.equal(y[..., :16], x[..., :16])  # the leading channels are not rotated
    z = torch.view_as_complex(x[..., 16:].double().reshape(5, 3, 4, 2).contiguous())
    angle = positions[:, None, None].double() * inv_freq.double()
    expected = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(5, 3, 8)
    assert torch.allclose(y[..., 16:].double(), expected, atol=1e-4)
    assert torch.allclose(ops.apply_rope(y, cos, -sin), x, atol=1e-5)
    single = ops.rope_cos_sin(positions[3:4], inv_freq)
    assert torch.equal(single[0], cos[3:4]) and torch.equal(single[1], sin[3:4])


def naive_attention(q, keys, biases, sinks, scale):
    k = torch.cat(keys, 1).double()
    logits = torch.einsum("ghd,gnd->ghn", q.double(), k) * scale + torch.cat(biases, -1).double()
    logits = torch.cat([logits, sinks.double().view(1, -1, 1).expand(q.shape[0], -1, 1)], -1)
    p = torch.softmax(logits, -1)[..., :-1]
    return torch.einsum("ghn,gnd->ghd", p, k)


def test_attention_with_sink_matches_naive_and_is_invariant():
    g = gen(5)
    q = torch.randn(20, 4, 32, generator=g)
    kw, kc = torch.randn(20, 16, 32, generator=g), torch.randn(20, 6, 32, generator=g)
    bw = torch.zeros(20, 1, 16)
    bw[:5, :, :10] = -math.inf  # early tokens see fewer window rows
    bc = torch.zeros(20, 1, 6)
    bc[:, :, 4:] = -math.inf
    sinks = torch.randn(4, generator=g)
    out = ops.attention_with_sink(q, [kw, kc], [bw, bc], sinks, 32**-0.5, True)
    assert torch.allclose(out.double(), naive_attention(q, [kw, kc], [bw, bc], sinks, 32**-0.5), atol=1e-5)
    for lo, hi in [(0, 1), (4, 5), (3, 11)]:
        part = ops.attention_with_sink(q[lo:hi], [kw[lo:hi], kc[lo:hi]], [bw[lo:hi], bc[lo:hi]], sinks, 32**-0.5, True)
        assert torch.equal(part, out[lo:hi])
    # a huge sink logit takes all the mass: the output goes to zero
    assert ops.attention_with_sink(q, [kw], [bw], torch.full((4,), 1e4), 0.1, True).abs().max() < 1e-6


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


def test_hc_pre_rows_are_invariant():
    g = gen(7)
    n, d = 4, 32
    streams = torch.randn(40, n, d, generator=g)
    fn, base, scale = torch.randn((2 + n) * n, n * d, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g), torch.ones(3)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, batch_invariant=True)
    full = ops.hc_pre(streams, fn, base, scale, **kw)
    for lo, hi in [(0, 1), (39, 40), (5, 22)]:
        part = ops.hc_pre(streams[lo:hi], fn, base, scale, **kw)
        assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part, full))
    post, comb, collapsed = full
    assert post.shape == (40, n) and comb.shape == (40, n, n) and collapsed.shape == (40, d)
    assert torch.all(post > 0) and torch.all(post < 2)


def test_rms_norm_and_swiglu_formulas():
    g = gen(8)
    x, w = torch.randn(6, 16, generator=g), torch.rand(16, generator=g) + 0.5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), expected, atol=1e-6)
    assert torch.allclose(ops.rms_norm_unweighted(x, 1e-6), expected / w, atol=1e-5)
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
    assert ops.backend_of("linear") == "torch_ref" and ops.linear is torch_ref.linear
