"""``Compressor.pool_entries`` through ``ops.compress_pool`` gives bitwise the numbers of the
inline torch code it replaced (kept below as the oracle), on CPU, for CSA (overlap + bias), HCA
and a bias-free compressor (V4.1), float32 and bf16, under the default and the reference routing."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.models.deepseek_v4.compressor import Compressor
from deepinfer.engine.models.deepseek_v4.context import NEG_INF, EntryPlan
from deepinfer.kernels import ops


def _old_pool_entries(comp: Compressor, kv, gate, ring_kv, ring_gate, plan: EntryPlan) -> torch.Tensor:
    """The gated branch of ``pool_entries`` before ``ops.compress_pool`` (commit 60c15d7)."""
    num_entries, span = plan.src_index.shape
    r, d = comp.ratio, comp.head_dim
    pool_kv = torch.cat([ring_kv.index_select(0, plan.ring_rows), kv])
    pool_gate = torch.cat([ring_gate.index_select(0, plan.ring_rows), gate])
    flat_index = plan.src_index.reshape(-1)
    src_kv = pool_kv.index_select(0, flat_index).view(num_entries, span, comp.width)
    src_gate = pool_gate.index_select(0, flat_index).view(num_entries, span, comp.width).float()
    bias = comp.position_bias
    if comp.overlap:
        src_kv = torch.cat([src_kv[:, :r, :d], src_kv[:, r:, d:]], dim=1)
        src_gate = torch.cat([src_gate[:, :r, :d] + bias[:, :d], src_gate[:, r:, d:] + bias[:, d:]], dim=1)
    elif bias is not None:
        src_gate = src_gate + bias
    src_gate = src_gate.masked_fill(~plan.src_valid[..., None], NEG_INF)
    weights = src_gate.softmax(dim=1).to(src_kv.dtype)
    return ops.rms_norm((src_kv * weights).sum(dim=1), comp.kv_norm.weight, comp.eps)


def _case(ratio: int, head_dim: int, overlap: bool, bias: bool, dtype, num_entries: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(16, head_dim, ratio, overlap, 1e-6, dtype=dtype, position_bias=bias)
    if bias:
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
    comp.kv_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    span = 2 * ratio if overlap else ratio
    num_fresh, num_ring, ring_size = 3 * span, span, 2 * span + 1
    fused = (torch.randn(num_fresh, 2 * comp.width + 3, generator=g) * 2).to(dtype)  # strided kv / gate rows
    ring_kv, ring_gate = (torch.randn(2, ring_size, comp.width, generator=g) * 2).to(dtype)
    valid = torch.rand(num_entries, span, generator=g) < 0.7
    valid[:, -1] = True
    plan = EntryPlan(ring_rows=torch.randperm(ring_size, generator=g)[:num_ring],
                     src_index=torch.randint(0, num_ring + num_fresh, (num_entries, span), generator=g),
                     src_valid=valid, cos=torch.empty(0), sin=torch.empty(0), dst_rows=torch.empty(0))
    return comp, (fused[:, : comp.width], fused[:, comp.width : 2 * comp.width], ring_kv, ring_gate, plan)


@pytest.mark.parametrize("routing", ["default", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ratio, head_dim, overlap, bias", [(4, 64, True, True), (128, 24, False, True),
                                                            (4, 100, False, True), (4, 64, False, False)],
                         ids=["csa", "hca", "hca-r4", "no-bias"])
@pytest.mark.parametrize("num_entries", [0, 1, 7])
def test_pool_entries_bitwise_as_the_inline_code(routing, dtype, ratio, head_dim, overlap, bias, num_entries):
    comp, args = _case(ratio, head_dim, overlap, bias, dtype, num_entries, seed=ratio * 1000 + num_entries)
    if routing == "reference":
        ops.use_reference()
    try:
        got, want = comp.pool_entries(*args), _old_pool_entries(comp, *args)
    finally:
        ops.reset()
    assert got.dtype == want.dtype and got.shape == (num_entries, head_dim)
    assert torch.equal(got, want)


def test_entry_without_valid_slots_is_nan_as_before():
    comp, args = _case(4, 64, True, True, torch.float32, 3, seed=1)
    args[-1].src_valid[1] = False
    got, want = comp.pool_entries(*args), _old_pool_entries(comp, *args)
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert torch.equal(got[[0, 2]], want[[0, 2]])
