"""Per-sequence state of the serving V4 model: rollback, bounded replay, batch validation."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.context import BatchError
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, hf_reference

BS = 16  # block size; CSA ratio 4, HCA ratio 16, window 16
LOOKAHEAD = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ref():
    return hf_reference(seed=5, layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)


def runner_for(ref, num_slots=3, num_blocks=90):
    return ModelRunner(ref.config, ref.state_dict, num_blocks=num_blocks, num_slots=num_slots, block_size=BS,
                       lookahead=LOOKAHEAD)  # fmt: skip


def tokens(n, seed=3, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one(runner, slot, table, start, toks, num_logits, **kw):
    return runner.execute(ForwardBatch([SeqStep(slot, slot, table, start, toks, num_logits=num_logits, **kw)]))


@pytest.mark.parametrize("prefix_len", [44, 61])
def test_rollback_up_to_lookahead_is_exact(ref, prefix_len):
    """A speculative run of `lookahead` wrong tokens (crossing CSA and HCA window ends), rolled
    back and recomputed with the right ones, gives the logits of a run that never speculated."""
    r = runner_for(ref)
    table = list(range(10))
    full = tokens(prefix_len + 12)
    clean = one(r, 0, table, 0, full, num_logits=len(full))

    spec_table = list(range(10, 20))
    one(r, 1, spec_table, 0, full[:prefix_len], num_logits=1)
    wrong = [(t + 1) % 512 for t in full[prefix_len : prefix_len + LOOKAHEAD]]
    one(r, 1, spec_table, prefix_len, wrong, num_logits=LOOKAHEAD)
    # every speculative token rejected: recompute from prefix_len with the right ones
    got = one(r, 1, spec_table, prefix_len, full[prefix_len:], num_logits=12)
    assert torch.equal(got, clean[prefix_len:])

    # partial acceptance: two right tokens speculated with four wrong ones, keep the two
    part_table = list(range(20, 30))
    one(r, 2, part_table, 0, full[:prefix_len], num_logits=1)
    draft = full[prefix_len : prefix_len + 2] + wrong[2:]
    drafted = one(r, 2, part_table, prefix_len, draft, num_logits=LOOKAHEAD)
    assert torch.equal(drafted[:2], clean[prefix_len : prefix_len + 2])
    got = one(r, 2, part_table, prefix_len + 2, full[prefix_len + 2 :], num_logits=10)
    assert torch.equal(got, clean[prefix_len + 2 :])


def test_replay_over_prefix_blocks_rebuilds_swa_exactly(ref):
    """Replay the last window*num_layers tokens of a cached prefix with the window truncated to
    the replay and compressed entries below the hit read from the block cache: the logits of the
    replay's last position and of every later decode equal the uninterrupted run's."""
    c = ref.config
    r = runner_for(ref)
    prefix_len = 150
    replay = min(prefix_len, c.sliding_window * c.num_hidden_layers)
    assert replay < prefix_len
    seq = tokens(prefix_len + 10, seed=4)
    table_a = list(range(0, 11))
    base = one(r, 0, table_a, 0, seq, num_logits=len(seq))

    # a prefix-cache hit: blocks holding the prefix's compressed entries, copied to new ids
    table_b = list(range(20, 31))
    r.blocks.copy_blocks(table_a, table_b)
    kw = dict(window_start=prefix_len - replay, write_from=prefix_len)
    rebuilt = one(r, 1, table_b, prefix_len - replay, seq[prefix_len - replay : prefix_len], num_logits=1, **kw)
    assert torch.equal(rebuilt[0], base[prefix_len - 1])
    for pos in range(prefix_len, len(seq)):
        got = one(r, 1, table_b, pos, [seq[pos]], num_logits=1, **kw)
        assert torch.equal(got[0], base[pos]), f"position {pos}"

    # control: a replay shorter than window*num_layers is only approximate
    table_c = list(range(40, 51))
    r.blocks.copy_blocks(table_a, table_c)
    short = c.sliding_window
    kw = dict(window_start=prefix_len - short, write_from=prefix_len)
    approx = one(r, 2, table_c, prefix_len - short, seq[prefix_len - short : prefix_len], num_logits=1, **kw)
    assert not torch.equal(approx[0], base[prefix_len - 1])


def test_replay_does_not_write_entries_below_write_from(ref):
    r = runner_for(ref, num_slots=2, num_blocks=30)
    seq = tokens(96, seed=6)
    table = list(range(6))
    one(r, 0, table, 0, seq, num_logits=1)
    before = {i: r.blocks.read_block(b) for i, b in enumerate(table)}
    one(r, 1, table, 32, seq[32:96], num_logits=1, window_start=32, write_from=96)
    after = {i: r.blocks.read_block(b) for i, b in enumerate(table)}
    for i in before:
        for name in before[i]:
            assert torch.equal(before[i][name], after[i][name]), f"block {i} {name} was rewritten"


@pytest.mark.parametrize(
    "steps, message",
    [
        ([SeqStep(0, 0, [0], 0, [1]), SeqStep(0, 1, [1], 0, [1])], "only once per forward"),
        ([SeqStep(0, 0, [0], 0, [1]), SeqStep(1, 0, [1], 0, [1])], "slot 0 is duplicated"),
        ([SeqStep(0, 7, [0], 0, [1])], "out of range"),
        ([SeqStep(0, 0, [0], 0, [])], "needs >= 1 token"),
        ([SeqStep(0, 0, [0], 0, [1, 2], num_logits=3)], "num_logits 3"),
        ([SeqStep(0, 0, [0], 0, [600])], "token ids must be in"),
        ([SeqStep(0, 0, [0], 4, [1], window_start=5, write_from=5)], "window_start 5"),
        ([SeqStep(0, 0, [0], 10, [1] * 30)], "need 3"),
    ],
)
def test_bad_batches_fail_with_a_message(ref, steps, message):
    r = runner_for(ref, num_slots=2, num_blocks=8)
    with pytest.raises(BatchError, match=message):
        r.execute(ForwardBatch(steps))


def test_empty_batch_is_rejected(ref):
    with pytest.raises(BatchError, match="no steps"):
        runner_for(ref, num_slots=1, num_blocks=2).execute(ForwardBatch([]))


@pytest.mark.parametrize("reference_ops", [False, True])
def test_batch_without_logits_returns_empty_and_keeps_state(ref, reference_ops):
    """Middle prefill chunks only (every num_logits 0): an empty [0, vocab] float32 result, and
    the state they wrote continues exactly like a run that asked for logits."""
    from deepinfer.kernels import ops

    if reference_ops:
        ops.use_reference()
    try:
        seq_a, seq_b = tokens(70, seed=8), tokens(45, seed=9)
        r = runner_for(ref, num_slots=2, num_blocks=20)
        got = r.execute(ForwardBatch([
            SeqStep(0, 0, list(range(10)), 0, seq_a[:50], num_logits=0),
            SeqStep(1, 1, list(range(10, 20)), 0, seq_b[:30], num_logits=0),
        ]))  # fmt: skip
        assert got.shape == (0, ref.config.vocab_size) and got.dtype == torch.float32
        assert r.execute_hidden(ForwardBatch([SeqStep(0, 0, list(range(10)), 50, seq_a[50:60], num_logits=0)])).shape[0] == 0
        tail = one(r, 0, list(range(10)), 60, seq_a[60:], num_logits=10)
        whole = one(runner_for(ref, num_slots=1, num_blocks=10), 0, list(range(10)), 0, seq_a, num_logits=10)
        assert torch.equal(tail, whole)
    finally:
        ops.reset()
