"""The host-side fast paths of a forward's context: the cached rope table rows equal the rows
computed for those positions alone, and the packing walk classifies every kind of field as the
plain type checks do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.core import cuda_graphs as cg
from deepinfer.engine.models.deepseek_v4 import index_plans


@settings(max_examples=60, deadline=None)
@given(positions=st.lists(st.integers(0, index_plans.ROPE_TABLE_POSITIONS + 3000), min_size=1, max_size=40),
       dim=st.sampled_from([2, 16, 32]), base=st.sampled_from([10_000.0, 160_000.0]))
def test_cached_rope_rows_equal_the_rows_of_those_positions_alone(positions, dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, dtype=torch.float32) / (2 * dim)))
    pos = np.asarray(positions, dtype=np.int64)
    cos, sin = index_plans.rope_tables(pos, inv_freq)
    for i, p in enumerate(positions):  # each position on its own, never from the table
        want_cos, want_sin = index_plans._rope_rows(np.array([p]), inv_freq.numpy())
        assert np.array_equal(cos[i].numpy(), want_cos[0]) and np.array_equal(sin[i].numpy(), want_sin[0])
    before = cos[0].clone()
    cos[0] += 1  # a forward's rows are its own: the table is not written through them
    assert torch.equal(index_plans.rope_tables(pos, inv_freq)[0][0], before)


@dataclasses.dataclass(frozen=True, slots=True)
class _Inner:
    rows: torch.Tensor
    count: int


@dataclasses.dataclass
class _Outer:
    inner: _Inner
    items: list
    table: dict
    shape: tuple
    scale: float
    name: str | None


def test_walk_keys_and_refusals():
    ctx = _Outer(_Inner(torch.arange(3), 2), [torch.zeros(2, 2), None], {"a": torch.ones(1)}, (1, 2), 0.5, None)
    lay = cg.layout(ctx)
    assert lay is not None and [leaf.key for leaf in lay.leaves] == ["rows", 0, "a"]
    sig = lay.signature
    other = _Outer(_Inner(torch.arange(3) + 7, 2), [torch.ones(2, 2), None], {"a": torch.zeros(1)}, (1, 2), 0.5, None)
    assert cg.layout(other).signature == sig  # values differ, shapes do not
    changed = _Outer(_Inner(torch.arange(4), 2), [torch.zeros(2, 2), None], {"a": torch.ones(1)}, (1, 2), 0.5, None)
    assert cg.layout(changed).signature != sig
    assert cg.layout(_Outer(_Inner(torch.arange(3), 3), [], {}, (), 0.5, None)).signature != sig
    for bad in ((torch.ones(1),), np.int64(3), object()):  # a tensor in a tuple, numpy ints, anything else
        assert cg.layout(dataclasses.replace(ctx, name=bad)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device tensor needs CUDA")
def test_walk_refuses_device_tensors():
    ctx = _Outer(_Inner(torch.arange(3, device="cuda"), 2), [], {}, (), 0.5, None)
    assert cg.layout(ctx) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-3, 5000), min_size=1, max_size=6))
def test_buckets_of_one_step_and_of_many_equal_the_scalar_rule(counts):
    arr = np.asarray(counts, dtype=np.int64)
    want = [index_plans.candidate_bucket(c) for c in counts]
    assert index_plans._buckets(arr).tolist() == want  # one path for one step, one for many
    assert [index_plans._buckets(arr[i : i + 1])[0] for i in range(len(counts))] == want


def test_the_runner_rescans_for_hooks_only_after_a_registration():
    """``ModelRunner._has_hooks`` (CUDA graphs skip hooks): a hook registered anywhere is seen at
    the next forward, a removed one too, and with no registration since a clean scan the scan is
    skipped (counted through the modules' hook dicts being read)."""
    from deepinfer.engine.core.model_runner import ModelRunner
    from deepinfer.engine.models.deepseek_v4.testing import PARITY_CONFIGS, hf_reference

    ref = hf_reference(seed=0, **PARITY_CONFIGS["mixed_hc2"])
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=8, num_slots=1, block_size=16)
    assert not runner._has_hooks()

    class Counting(list):
        reads = 0

        def __iter__(self):
            Counting.reads += 1
            return super().__iter__()

    runner._modules = Counting(runner._modules)
    assert not runner._has_hooks() and Counting.reads == 0  # nothing registered since the scan
    handle = runner.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: None)
    assert runner._has_hooks() and Counting.reads == 1
    handle.remove()
    assert not runner._has_hooks() and Counting.reads == 2  # hooked last time: looked again
    assert not runner._has_hooks() and Counting.reads == 2
