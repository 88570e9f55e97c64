"""Triton lightning-indexer scores (kernels/gpu_indexer.py) against torch_ref.index_scores: random
token/head counts, head dims and candidate counts off the tiles (fewer candidates than one tile,
none), valid masks from none to all (rows with no valid candidate), q as a strided slice as the
model passes it, keys shared by every token (stride 0, as a prefill group passes them), poisoned
outputs; a token's scores do not depend on the call's other tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer.kernels import ops, torch_ref
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_indexer, gpu_routing  # noqa: E402 - Triton only where the kernels can run

pytestmark = cases.marks()


def _case(num, heads, dim, width, valid_share, dtype, seed, strided=False, shared=False):
    g = cases.gen(seed)
    if strided:  # the model's q is a column slice of a wider projection: rows of stride > H * Di
        q = cases.randn(num, heads * dim + 24, dtype=dtype, gen=g)[:, 24:].view(num, heads, dim)
    else:
        q = cases.randn(num, heads, dim, dtype=dtype, gen=g)
    keys = cases.randn(num, width, dim, dtype=dtype, gen=g)
    if shared:  # a prefill group's tokens read one step's candidates: [1, B, Di] viewed as [G, B, Di]
        keys = keys[:1].expand(num, -1, -1)
    weights = cases.randn(num, heads, gen=g, scale=heads**-0.5)
    valid = torch.rand(num, width, generator=g) < valid_share
    if num > 1:
        valid[num // 2] = False  # a token with no closed candidate yet
    return q, weights, keys, valid.to(cases.DEVICE)


def _check(got, q, weights, keys, valid, dtype):
    want = torch_ref.index_scores(q.double(), weights.double(), keys.double(), valid)
    assert got.dtype == torch.float32 and got.shape == valid.shape
    assert not torch.isnan(got).any(), "an output element was never written"
    assert torch.equal(torch.isneginf(got), ~valid), "-inf exactly where a candidate is not valid"
    assert torch.isfinite(got[valid]).all()
    assert cases.rel_err(got[valid], want[valid]) < cases.tol(dtype)


@settings(cases.examples(), max_examples=12)
@example(num=3, heads=64, dim=128, width=130, valid_share=0.7, dtype=torch.bfloat16, strided=True, seed=1, shared=False)
@example(num=2, heads=5, dim=20, width=9, valid_share=0.0, dtype=torch.float32, strided=False, seed=2, shared=False)
@example(num=37, heads=64, dim=128, width=130, valid_share=0.5, dtype=torch.bfloat16, strided=True, seed=3,
         shared=True)
@given(num=st.integers(1, 40), heads=st.integers(1, 70), dim=st.sampled_from([8, 20, 64, 100, 128]),
       width=st.integers(1, 200), valid_share=st.sampled_from([0.0, 0.5, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(), seed=st.integers(0, 2**31),
       shared=st.booleans())
def test_index_scores(num, heads, dim, width, valid_share, dtype, strided, seed, shared):
    q, weights, keys, valid = _case(num, heads, dim, width, valid_share, dtype, seed, strided, shared)
    with cases.poisoned_allocations():
        got = gpu_indexer.index_scores(q, weights, keys, valid)
    _check(got, q, weights, keys, valid, dtype)


def test_bf16_rounds_the_products_as_the_reference_does():
    """The reference rounds q.k to bf16 before relu: the kernel is nearer to it than to float64."""
    if cases.INTERPRETED:
        pytest.skip("the interpreter's casts to bf16 truncate: its roundings are not the device's")
    q, weights, keys, valid = _case(1, 64, 128, 1000, 1.0, torch.bfloat16, 7)
    got = gpu_indexer.index_scores(q, weights, keys, valid)
    same_dtype = torch_ref.index_scores(q, weights, keys, valid)
    exact = torch_ref.index_scores(q.double(), weights.double(), keys.double(), valid)
    assert cases.rel_err(got, same_dtype) < 0.5 * cases.rel_err(got, exact)


def test_a_tokens_scores_do_not_depend_on_the_other_tokens():
    """133 tokens take one program each; one token alone has its 3 candidate blocks split over
    programs: the same numbers, bit for bit."""
    q, weights, keys, valid = _case(133, 16, 32, 130, 0.5, torch.bfloat16, 3)
    assert gpu_indexer.block_n(32) == 64 and gpu_indexer._TARGET_PROGRAMS // 133 == 1
    full = gpu_indexer.index_scores(q, weights, keys, valid, batch_invariant=True)
    for i in (0, 66, 132):
        one = gpu_indexer.index_scores(q[i : i + 1], weights[i : i + 1], keys[i : i + 1], valid[i : i + 1], True)
        assert torch.equal(one, full[i : i + 1]), i
    _check(full, q, weights, keys, valid, torch.bfloat16)


def test_no_tokens_or_no_candidates():
    q, weights, keys, valid = _case(3, 4, 16, 5, 1.0, torch.float32, 0)
    assert gpu_indexer.index_scores(q[:0], weights[:0], keys[:0], valid[:0]).shape == (0, 5)
    assert gpu_indexer.index_scores(q, weights, keys[:, :0], valid[:, :0]).shape == (3, 0)


def test_routing_keeps_cpu_on_the_reference():
    """CPU tensors keep the default routing (the torch reference, so the model's CPU numbers are
    those of the inline code it replaced); CUDA tensors take the kernel."""
    q, weights, keys, valid = (t.cpu() for t in _case(5, 8, 64, 40, 0.5, torch.bfloat16, 4))
    ops.reset()  # a CUDA model built earlier in this process routed the GPU kernels in
    assert ops._active["index_scores"] is torch_ref.index_scores
    inline = (torch.relu(torch.bmm(q, keys.transpose(1, 2)).float()) * 64**-0.5 * weights[:, :, None]).sum(1)
    assert torch.equal(ops.index_scores(q, weights, keys, valid), inline.masked_fill(~valid, float("-inf")))
    try:
        for name, fn in gpu_routing.routing(ops._active).items():
            ops.register(name, fn)
        assert ops.backend_of("index_scores") == gpu_routing.__name__
        assert torch.equal(ops.index_scores(q, weights, keys, valid), torch_ref.index_scores(q, weights, keys, valid))
        if cases.HAS_CUDA:
            args = [t.cuda() for t in (q, weights, keys, valid)]
            assert torch.equal(ops.index_scores(*args), gpu_indexer.index_scores(*args))
    finally:
        ops.reset()
