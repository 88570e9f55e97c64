"""The Triton compressor kernel (kernels/gpu_compressor.py) against torch_ref.compress_pool in
float64 on random entries: ratios 1 .. 128, overlap (CSA) or not (HCA), with and without the
position bias, head dims off the powers of two, source rows mixed from the ring and the fresh
(strided) rows, partially masked slots, bf16 and float32, poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer.kernels import torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_compressor, gpu_routing  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()
EPS = 1e-6
MAX_EXAMPLES = 40  # one compile per shape class, and the interpreter runs an entry in ~0.1 s


def _inputs(num_entries: int, ratio: int, head_dim: int, overlap: bool, bias: bool, dtype, seed: int,
            keep: float = 0.7) -> dict:
    """Arguments of ``compress_pool``: every entry reads ring and fresh rows at random; slots
    are valid with probability ``keep``, the last one always (the planner's own window)."""
    g = cases.gen(seed)
    span = 2 * ratio if overlap else ratio
    width = 2 * head_dim if overlap else head_dim
    num_fresh = int(torch.randint(1, 2 * span + 2, (1,), generator=g))
    num_ring = int(torch.randint(0, 2 * span + 1, (1,), generator=g))
    ring_size = num_ring + 3
    fused = cases.randn(num_fresh, 2 * width + 5, dtype=dtype, gen=g, scale=2.0)  # kv | gate | more: strided rows
    valid = torch.rand(num_entries, span, generator=g) < keep
    valid[:, -1] = True
    return dict(
        kv=fused[:, :width],
        gate=fused[:, width : 2 * width],
        ring_kv=cases.randn(ring_size, width, dtype=dtype, gen=g, scale=2.0),
        ring_gate=cases.randn(ring_size, width, dtype=dtype, gen=g, scale=2.0),
        ring_rows=torch.randperm(ring_size, generator=g)[:num_ring].to(cases.DEVICE),
        src_index=torch.randint(0, num_ring + num_fresh, (num_entries, span), generator=g).to(cases.DEVICE),
        src_valid=valid.to(cases.DEVICE),
        position_bias=(torch.randn(ratio, width, generator=g) * 2).to(cases.DEVICE) if bias else None,
        ratio=ratio,
        head_dim=head_dim,
        overlap=overlap,
        norm_weight=(torch.rand(head_dim, generator=g) + 0.5).to(cases.DEVICE),
        eps=EPS,
    )


def _float64(args: dict) -> dict:
    rows = ("kv", "gate", "ring_kv", "ring_gate")
    return {k: v.double() if k in rows else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@settings(cases.examples(), max_examples=MAX_EXAMPLES)
@given(entries=st.integers(0, 5), ratio=st.sampled_from([1, 2, 4, 8, 16, 128]),
       head_dim=st.sampled_from([24, 64, 100, 512]), bias=st.booleans(), seed=st.integers(0, 2**31))
@example(entries=0, ratio=4, head_dim=512, bias=True, seed=0)
@example(entries=1, ratio=128, head_dim=512, bias=True, seed=1)
def test_compress_pool(overlap, dtype, entries, ratio, head_dim, bias, seed):
    args = _inputs(entries, ratio, head_dim, overlap, bias, dtype, seed)
    with cases.poisoned_allocations():
        got = gpu_compressor.compress_pool(**args)
    want = torch_ref.compress_pool(**_float64(args))
    assert got.shape == (entries, head_dim) and got.dtype == dtype
    assert cases.rel_err(got, want) < cases.tol(dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's -inf - -inf
@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
def test_entry_without_valid_slots_is_nan_like_the_reference(overlap):
    args = _inputs(3, 4, 64, overlap, True, torch.float32, seed=7)
    args["src_valid"][1] = False
    got = gpu_compressor.compress_pool(**args)
    want = torch_ref.compress_pool(**args)
    assert torch.isnan(want[1]).all() and torch.isnan(got[1]).all()
    keep = torch.tensor([0, 2], device=cases.DEVICE)
    assert cases.rel_err(got[keep], want[keep]) < cases.F32_TOL


def _junk_rows_for_invalid_slots(args: dict, value: float) -> dict:
    """``args`` with one more ring row and one more fresh row holding ``value``, and every
    invalid slot reading one of them (alternately)."""
    num_ring, num_fresh = args["ring_rows"].numel(), args["kv"].shape[0]

    def more(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows, torch.full_like(rows[:1], value)])

    index = args["src_index"]
    index = torch.where(index >= num_ring, index + 1, index)  # the fresh rows start one later
    junk = torch.where(torch.arange(index.numel(), device=index.device).view(index.shape) % 2 == 0,
                       num_ring, num_ring + 1 + num_fresh)
    ring_rows = torch.cat([args["ring_rows"], torch.tensor([args["ring_kv"].shape[0]], device=index.device)])
    return {**args, "kv": more(args["kv"]), "gate": more(args["gate"]), "ring_kv": more(args["ring_kv"]),
            "ring_gate": more(args["ring_gate"]), "ring_rows": ring_rows,
            "src_index": torch.where(args["src_valid"], index, junk)}


def test_invalid_slots_are_never_read():
    """An invalid slot has weight 0: NaN rows behind the invalid slots leave every entry as the
    reference computes it with finite rows there (the reference itself would give NaN)."""
    args = _inputs(4, 8, 100, True, True, torch.float32, seed=3, keep=0.5)
    want = torch_ref.compress_pool(**_float64(_junk_rows_for_invalid_slots(args, 1.0)))
    got = gpu_compressor.compress_pool(**_junk_rows_for_invalid_slots(args, float("nan")))
    assert cases.rel_err(got, want) < cases.F32_TOL


def test_shapes_that_do_not_fit_and_the_routing_check():
    args = _inputs(2, 4, 64, True, True, torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not fit ratio"):
        gpu_compressor.compress_pool(**{**args, "ratio": 2})
    with pytest.raises(ValueError, match="position_bias"):
        gpu_compressor.compress_pool(**{**args, "position_bias": args["position_bias"][:2]})
    _, fits = gpu_routing.KERNELS["compress_pool"]
    assert fits(**args)
    assert not fits(**{**args, "head_dim": 2048})
    assert not fits(**{**args, "gate": args["gate"].double()})
