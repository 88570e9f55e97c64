"""Native CPU kernels added for decode speed: gathered attention, mHC post, MoE dispatch plan."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.models.deepseek_v4.moe import DENSE_ROWS_PER_CALL, MoE, RoutePlan
from deepinfer.engine.models.deepseek_v4.testing import SLIDING, hf_reference
from deepinfer.kernels import cpu_native, torch_ref

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler for the native kernels")


def attention_case(g=37, h=4, d=32, window=9, num_extra=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(50, d, generator=gen)
    pool[-1] = 0  # the sink row
    rows = torch.randint(0, 49, (g, window + 1), generator=gen)
    rows[:, -1] = 49
    valid = torch.rand(g, window + 1, generator=gen) > 0.2
    valid[:, -1] = True
    bias = torch.where(valid, 0.0, float("-inf"))[:, None, :]
    extra = torch.randn(20, d, generator=gen)
    extra_rows = torch.randint(0, 20, (g, num_extra), generator=gen)
    extra_bias = torch.where(torch.rand(g, num_extra, generator=gen) > 0.3, 0.0, float("-inf"))[:, None, :]
    q = torch.randn(g, h, d, generator=gen)
    sinks = torch.randn(h, generator=gen)
    return q, pool, rows, bias, extra, extra_rows, extra_bias, sinks


@pytest.mark.parametrize("with_extra", [False, True])
def test_gathered_attention_matches_reference_and_each_token_stands_alone(with_extra):
    q, pool, rows, bias, extra, extra_rows, extra_bias, sinks = attention_case()
    if not with_extra:
        extra = extra_rows = extra_bias = None
    args = (pool, rows, bias, extra, extra_rows, extra_bias, sinks, 0.2)
    got = cpu_native.gathered_attention(q, *args, True)
    want = torch_ref.gathered_attention(q, *args, True)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    for lo, hi in [(0, 1), (5, 17), (30, 37)]:
        sub = (pool, rows[lo:hi], bias[lo:hi]) + (
            (None, None, None) if extra is None else (extra, extra_rows[lo:hi], extra_bias[lo:hi])
        ) + (sinks, 0.2)  # fmt: skip
        assert torch.equal(cpu_native.gathered_attention(q[lo:hi], *sub, True), got[lo:hi])


def test_gathered_attention_falls_back_for_other_dtypes():
    q, pool, rows, bias, extra, extra_rows, extra_bias, sinks = attention_case(d=32)
    args = (pool.double(), rows, bias.double(), None, None, None, sinks.double(), 0.2)
    got = cpu_native.gathered_attention(q.double(), *args)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch_ref.gathered_attention(q.double(), *args))


def test_hc_post_matches_reference_per_row():
    gen = torch.Generator().manual_seed(1)
    streams, out = torch.randn(23, 4, 64, generator=gen), torch.randn(23, 64, generator=gen)
    post, comb = torch.rand(23, 4, generator=gen), torch.rand(23, 4, 4, generator=gen)
    got = cpu_native.hc_post(out, streams, post, comb)
    assert torch.allclose(got, torch_ref.hc_post(out, streams, post, comb), atol=1e-6)
    assert torch.equal(cpu_native.hc_post(out[3:9], streams[3:9], post[3:9], comb[3:9]), got[3:9])


@pytest.mark.parametrize("num_tokens", [1, 3, 5, 8, 13, 70])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_native_moe_dispatch_equals_the_python_plan(num_tokens, batch_invariant, monkeypatch):
    ref = hf_reference(seed=2, layer_types=[SLIDING, SLIDING], n_routed_experts=16, num_experts_per_tok=4)
    moe = MoE(ref.config, 1)
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4].sort().values for _ in range(num_tokens)])
    plan = RoutePlan(ids, torch.rand(num_tokens, 4, generator=gen))
    token_of_row, row_of_pair, segments, rows_per_expert = cpu_native.moe_dispatch(
        ids, 16, batch_invariant, DENSE_ROWS_PER_CALL
    )
    monkeypatch.setattr(cpu_native, "moe_dispatch", lambda *a: None)  # the numpy / Python planners
    want = moe.dispatch(plan, batch_invariant)
    assert torch.equal(token_of_row, want.token_of_row) and torch.equal(row_of_pair, want.row_of_pair)
    assert segments == [tuple(s) for s in want.segments] and rows_per_expert == want.rows_per_expert


@pytest.mark.parametrize("h,d", [(3, 40), (8, 64), (6, 128)])  # odd heads / ragged channels take the generic pass
def test_gathered_attention_head_and_channel_layouts(h, d):
    q, pool, rows, bias, extra, extra_rows, extra_bias, sinks = attention_case(g=19, h=h, d=d, seed=h)
    args = (pool, rows, bias, extra, extra_rows, extra_bias, sinks, d**-0.5)
    got = cpu_native.gathered_attention(q, *args, True)
    assert torch.allclose(got, torch_ref.gathered_attention(q, *args, True), atol=2e-6, rtol=1e-5)
    sub = (pool, rows[4:9], bias[4:9], extra, extra_rows[4:9], extra_bias[4:9], sinks, d**-0.5)
    assert torch.equal(cpu_native.gathered_attention(q[4:9], *sub, True), got[4:9])
