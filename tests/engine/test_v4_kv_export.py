"""KV state export/import of the ModelRunner: blocks and SWA slots move between runners exactly."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cache.block_cache import BlockCacheError
from deepinfer.cache.swa_state import SwaStateError
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, hf_reference

BS = 16  # CSA ratio 4, HCA ratio 16, window 16
LOOKAHEAD = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ref():
    return hf_reference(seed=7, layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)


def runner_for(ref, num_blocks=24, num_slots=3):
    return ModelRunner(ref.config, ref.state_dict, num_blocks=num_blocks, num_slots=num_slots, block_size=BS,
                       lookahead=LOOKAHEAD)  # fmt: skip


def tokens(n, seed=3):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one(runner, slot, table, start, toks, num_logits=1):
    return runner.execute(ForwardBatch([SeqStep(slot, slot, table, start, toks, num_logits=num_logits)]))


def test_layout_describes_blocks_and_slots(ref):
    r = runner_for(ref)
    layout = r.kv_layout()
    assert layout == runner_for(ref, num_blocks=5, num_slots=1).kv_layout()  # pool sizes are not layout
    assert layout.bytes_per_block == r.blocks.bytes_per_block
    assert layout.bytes_per_slot == r.swa.bytes_per_slot
    blocks = r.read_blocks([3, 1])
    assert {t.name for t in layout.block_tensors} == set(blocks)
    for t in layout.block_tensors:
        assert blocks[t.name].shape == (2, *t.shape) and blocks[t.name].dtype == t.dtype
        assert blocks[t.name].device.type == "cpu"
    by_name = {t.name: t for t in layout.block_tensors}
    assert by_name["1.compressed"].shape == (BS // 4, ref.config.head_dim)
    assert by_name["2.compressed"].ratio == 16 and "2.indexer_keys" not in by_name
    slot = r.read_slot(2)
    rings = {t.name: t for t in layout.slot_tensors}
    assert set(rings) == set(slot) and all(slot[n].shape == rings[n].shape for n in slot)
    assert rings["0.window"].span == ref.config.sliding_window and rings["1.comp_kv"].span == 8
    assert rings["2.comp_kv"].span == 16 and "2.index_kv" not in rings
    assert layout != runner_for(ref).__class__(ref.config, ref.state_dict, num_blocks=2, num_slots=1,
                                               block_size=32, lookahead=LOOKAHEAD).kv_layout()  # fmt: skip


def test_moved_sequence_decodes_like_one_that_never_moved(ref):
    """Prefill 75 tokens on runner A, export its blocks and slot, import into a fresh runner B
    under other block ids and another slot, decode there: logits equal A's continuing run."""
    seq = tokens(75 + 12)
    a = runner_for(ref)
    table_a = [5, 9, 2, 14, 7, 11]
    one(a, 1, table_a, 0, seq[:75])
    n = 75
    blocks = a.read_blocks(table_a[: -(-n // BS)])
    slot = a.read_slot(1)
    expected = [one(a, 1, table_a, p, [seq[p]]) for p in range(n, len(seq))]

    b = runner_for(ref)
    assert b.kv_layout() == a.kv_layout()
    table_b = [20, 3, 17, 0, 8, 1]
    b.write_blocks(table_b[: -(-n // BS)], blocks)
    b.write_slot(0, slot)
    got = [one(b, 0, table_b, p, [seq[p]]) for p in range(n, len(seq))]
    for p, (x, y) in enumerate(zip(got, expected)):
        assert torch.equal(x, y), f"position {n + p}"


@pytest.mark.parametrize("later", [0, 3])
def test_slot_saved_at_a_block_boundary_restores_there(ref, later):
    """Blocks 0..3 and the slot read at n' = 64 + later (later <= lookahead) restore the sequence
    at num_computed_tokens 64: its continuation from 64 (with other tokens than the ones A took
    after 64) equals an uninterrupted run of the same tokens."""
    seq = tokens(64 + 20, seed=5)
    other = tokens(later, seed=6)
    a = runner_for(ref)
    table_a = list(range(6))
    one(a, 0, table_a, 0, seq[:64])
    if later:
        one(a, 0, table_a, 64, other, num_logits=later)  # speculative tokens to be rolled back
    blocks, slot = a.read_blocks(table_a[:4]), a.read_slot(0)

    b = runner_for(ref)
    table_b = [10, 12, 14, 16, 18, 20]
    b.write_blocks(table_b[:4], blocks)
    b.write_slot(2, slot)
    got = one(b, 2, table_b, 64, seq[64:], num_logits=20)
    whole = one(runner_for(ref), 0, table_a, 0, seq, num_logits=20)
    assert torch.equal(got, whole)


def test_bad_imports_fail_with_a_message(ref):
    r = runner_for(ref)
    blocks, slot = r.read_blocks([0, 1]), r.read_slot(0)
    with pytest.raises(BlockCacheError, match="expected"):
        r.write_blocks([2], blocks)  # two blocks' rows for one id
    with pytest.raises(BlockCacheError, match="duplicate"):
        r.write_blocks([2, 2], blocks)
    with pytest.raises(BlockCacheError, match="out of range"):
        r.write_blocks([2, 99], blocks)
    with pytest.raises(BlockCacheError, match="missing tensors"):
        r.write_blocks([2, 3], {k: v for k, v in blocks.items() if k != "1.compressed"})
    with pytest.raises(BlockCacheError, match="float64"):
        r.write_blocks([2, 3], {k: v.double() for k, v in blocks.items()})
    with pytest.raises(SwaStateError, match="expected"):
        r.write_slot(1, {k: v[:-1] for k, v in slot.items()})
    with pytest.raises(SwaStateError, match="out of range"):
        r.read_slot(3)
