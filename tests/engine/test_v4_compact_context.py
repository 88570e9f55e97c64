"""Compact token groups (``Geometry.compact_candidates``, a model off the CPU): the same forward as
the full form. A prefill chunk's groups store one candidate row per group and a closed-entry count
per token, and a [G, 4] window plan per token; ``TokenGroup.expand_candidates`` builds the [G, B]
views, valid and bias, ``expand_window`` the window rows and bias."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.core import cuda_graphs
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner, with_dump_block
from deepinfer.engine.models.deepseek_v4.context import MERGE_STEP_TOKENS, build_context
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, hf_reference

BLOCK = 16
SLOTS = 4
PER_SEQ = 40  # blocks of each sequence's table


@pytest.fixture(scope="module")
def ref():
    return hf_reference(seed=3, layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)


@pytest.fixture(scope="module")
def ref_wide():
    """A window wider than WINDOW_GRANULE: short sequences' window key sets are shorter."""
    return hf_reference(seed=4, layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2, sliding_window=96)


def _runner(ref, compact: bool, max_rows: int = 300) -> ModelRunner:
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=SLOTS * PER_SEQ, num_slots=SLOTS, block_size=BLOCK,
                         device="cpu", dtype=torch.float32, cuda_graphs=False)  # fmt: skip
    runner.geometry = dataclasses.replace(runner.geometry, compact_candidates=compact, max_group_key_rows=max_rows)
    return runner


def _batch(rng: random.Random, decode: bool) -> ForwardBatch:
    steps = []
    for i in range(rng.randrange(1, SLOTS + 1)):
        start = rng.choice([0, rng.randrange(0, 60), rng.randrange(0, 500)])
        n = 1 if decode else rng.choice([1, rng.randrange(1, 30), rng.randrange(1, 120)])
        table = [rng.randrange(SLOTS * PER_SEQ) for _ in range(-(-(start + n) // BLOCK) + rng.randrange(3))]
        steps.append(SeqStep(i, i, table, start, [rng.randrange(100) for _ in range(n)], num_logits=1,
                             write_from=0 if rng.random() < 0.8 else rng.randrange(start + 1)))  # fmt: skip
    return ForwardBatch(steps)


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), decode=st.booleans(), max_rows=st.sampled_from([200, 1000, 1 << 17]))
def test_expanded_compact_groups_equal_the_full_form(ref, seed, decode, max_rows):
    geo = _runner(ref, False, max_rows).geometry
    batch = _batch(random.Random(seed), decode)
    full = build_context(batch, geo, device=torch.device("cpu"), batch_invariant=False)
    compact = build_context(batch, dataclasses.replace(geo, compact_candidates=True), device=torch.device("cpu"),
                            batch_invariant=False)  # fmt: skip
    assert full.compress.keys() == compact.compress.keys()
    pairs = [(full.window.groups, compact.window.groups)]
    pairs += [(plan.groups, compact.compress[kind].groups) for kind, plan in full.compress.items()]
    for groups, other in pairs:
        assert len(groups) == len(other)
        for g, c in zip(groups, other):
            # the window: a [G, 4] plan expanded to the full form's rows and bias
            assert c.win_index is None and c.win_bias is None and c.win_plan.shape == (g.win_bias.shape[0], 4)
            c.expand_window()
            assert torch.equal(c.win_index, g.win_index) and torch.equal(c.win_bias, g.win_bias)
    for kind, plan in full.compress.items():
        other = compact.compress[kind].groups
        for g, c in zip(plan.groups, other):
            assert (g.window_len, g.num_candidates) == (c.window_len, c.num_candidates)
            if not g.num_candidates:
                continue
            assert c.cand_valid is None and c.cand_bias is None and c.cand_count is not None
            # one row per group (one step), per step with each token's step, or per token (decode)
            stored = c.cand_rows.shape[0] if c.cand_rows is not None else None
            assert (c.cand_rows is None) == (c.cand_table is not None) == (c.cand_step is not None)
            if c.cand_table is not None:
                assert c.cand_table.shape[0] <= g.cand_rows.shape[0] and c.cand_step.shape == (g.cand_rows.shape[0],)
            c.expand_candidates()
            assert c.cand_rows.shape == g.cand_rows.shape
            assert c.shared_rows == (stored == 1 < g.cand_rows.shape[0])
            assert torch.equal(c.cand_rows, g.cand_rows)
            assert torch.equal(c.cand_valid, g.cand_valid)
            assert torch.equal(c.cand_bias, g.cand_bias)


@pytest.mark.timeout(300)
def test_forward_with_compact_candidates_equals_the_full_form(ref):
    outs = {}
    for compact in (False, True):
        runner = _runner(ref, compact)
        rng = random.Random(0)
        pos = [0] * 3
        logits = []
        for it in range(6):  # three prefill chunks of mixed lengths, then decodes
            steps = []
            for i in range(3):
                n = rng.randrange(1, 90) if it < 3 else 1
                steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                     [rng.randrange(100) for _ in range(n)], num_logits=1))  # fmt: skip
                pos[i] += n
            logits.append(runner.execute(ForwardBatch(steps)))
        outs[compact] = torch.cat(logits)
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_expand_candidates_reads_the_counts_on_every_call(ref):
    """A graph replay runs the launches captured from the second forward of one context after the
    counts were overwritten in place: expanding again must read them, not keep the first masks."""
    geo = dataclasses.replace(_runner(ref, False).geometry, compact_candidates=True)
    batch = ForwardBatch([SeqStep(0, 0, list(range(PER_SEQ)), 200, list(range(40)), num_logits=1)])
    ctx = build_context(batch, geo, device=torch.device("cpu"), batch_invariant=False)
    group = next(g for plan in ctx.compress.values() for g in plan.groups if g.num_candidates)
    group.expand_candidates()
    first = group.cand_valid.clone()
    assert first.any()
    group.cand_count.zero_()
    group.expand_candidates()
    assert not group.cand_valid.any() and torch.isneginf(group.cand_bias).all()
    assert group.cand_rows.shape == first.shape


def _merged(runner: ModelRunner) -> ModelRunner:
    runner.geometry = dataclasses.replace(runner.geometry, merge_step_tokens=MERGE_STEP_TOKENS)
    return runner


def _key_sets(group, num_tokens: int) -> dict[int, set]:
    """token -> the pool rows it attends to, window and candidates (unmasked only)."""
    group.expand_window()
    if group.num_candidates:
        group.expand_candidates()
    tokens = range(num_tokens) if group.token_index is None else group.token_index.tolist()
    win = group.win_index.view(len(tokens), -1)
    out = {}
    for i, t in enumerate(tokens):
        keys = {("w", int(r)) for r, b in zip(win[i].tolist(), group.win_bias[i, 0].tolist()) if b == 0.0}
        if group.num_candidates:
            keys |= {("c", int(r)) for r, ok in zip(group.cand_rows[i].tolist(), group.cand_valid[i].tolist()) if ok}
        out[t] = keys
    return out


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), wide=st.booleans())
def test_merged_decode_groups_keep_every_tokens_keys(ref, ref_wide, seed, wide):
    """A decode or verify forward (every step <= MERGE_STEP_TOKENS tokens) keeps one token group
    per layer kind, and each token attends to exactly the keys it has in the per-shape groups."""
    rng = random.Random(seed)
    geo = _runner(ref_wide if wide else ref, True, 1 << 20).geometry
    steps = []
    for i in range(rng.randrange(2, SLOTS + 1)):
        start = rng.choice([rng.randrange(0, 20), rng.randrange(0, 120), rng.randrange(0, 600)])
        n = rng.choice([1, rng.randrange(1, 7)])
        table = [rng.randrange(SLOTS * PER_SEQ) for _ in range(-(-(start + n) // BLOCK))]
        steps.append(SeqStep(i, i, table, start, [rng.randrange(100) for _ in range(n)], num_logits=n))
    batch = ForwardBatch(steps)
    num_tokens = sum(s.num_tokens for s in steps)
    split = build_context(batch, geo, device=torch.device("cpu"), batch_invariant=False)
    merged = build_context(batch, dataclasses.replace(geo, merge_step_tokens=MERGE_STEP_TOKENS),
                           device=torch.device("cpu"), batch_invariant=False)  # fmt: skip
    pairs = [(split.window.groups, merged.window.groups)]
    pairs += [(plan.groups, merged.compress[kind].groups) for kind, plan in split.compress.items()]
    for groups, other in pairs:
        assert len(other) == 1  # one structure whatever the tokens' shapes
        want: dict[int, set] = {}
        for g in groups:
            want.update(_key_sets(g, num_tokens))
        got = _key_sets(other[0], num_tokens)
        assert got == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wide", [False, True])
def test_forward_with_merged_decode_groups_equals_split_groups(ref, ref_wide, wide):
    """Prefill chunks (not merged), then decode and verify-sized steps of sequences at different
    lengths, one shorter than the window (merged): the logits of every step within float32
    rounding of the per-shape groups', and the same greedy tokens."""
    outs = {}
    for merge in (False, True):
        runner = _runner(ref_wide if wide else ref, True, 1 << 20)
        if merge:
            _merged(runner)
        rng = random.Random(1)
        pos = [0] * 3
        logits = []
        for it in range(10):
            steps = []
            for i in range(3):
                if it < 3:  # sequence 0 stays shorter than the wide window until its decodes
                    n = rng.randrange(1, 10) if i == 0 else rng.randrange(1, 150)
                else:
                    n = rng.choice([1, 1, rng.randrange(2, 7)])
                steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                     [rng.randrange(100) for _ in range(n)], num_logits=1 if it < 3 else n))  # fmt: skip
                pos[i] += n
            logits.append(runner.execute(ForwardBatch(steps)))
        outs[merge] = torch.cat(logits)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[True].argmax(-1), outs[False].argmax(-1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wide", [False, True])
def test_padded_entries_write_only_the_dump_block(ref, ref_wide, wide):
    """Decode and verify forwards of a runner that replays CUDA graphs pad their closing entries
    (``Geometry.dump_block``): every step's logits and every real block-cache row equal the
    unpadded forward's (float32 rounding), the padding lands in the dump block only, and a padded
    forward's CUDA-graph signature depends on its token count alone (not on how many windows close
    or how many steps hold the tokens: per-step pools are laid out for ``padded_steps``)."""
    outs, caches = {}, {}
    for pad in (False, True):
        runner = _merged(_runner(ref_wide if wide else ref, True, 1 << 20))
        if pad:
            runner.geometry = with_dump_block(runner.geometry, runner.blocks.dump_block)
        rng = random.Random(2)
        pos = [0] * 3
        logits = []
        for it in range(12):
            steps = []
            for i in range(3):
                n = rng.randrange(1, 150) if it < 2 else rng.choice([1, 1, rng.randrange(2, 7)])
                steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                     [rng.randrange(100) for _ in range(n)], num_logits=1 if it < 2 else n))  # fmt: skip
                pos[i] += n
            logits.append(runner.execute(ForwardBatch(steps)))
        outs[pad] = torch.cat(logits)
        caches[pad] = {spec: runner.blocks.flat(spec.layer, spec.name).clone() for spec in runner.blocks.specs}
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[True].argmax(-1), outs[False].argmax(-1))
    dumped = 0
    for spec, padded in caches[True].items():
        real = SLOTS * PER_SEQ * (BLOCK // spec.ratio)  # rows of the real blocks, the dump block after them
        # the indexer keys are projected over the entries at once: float32 rounding of another row count
        torch.testing.assert_close(padded[:real], caches[False][spec][:real], rtol=1e-5, atol=1e-6)
        assert not caches[False][spec][real:].any()  # unpadded forwards never write the dump block
        dumped += int(padded[real:].abs().sum() > 0)
    assert dumped  # the padding was written (to the dump block)
    geo = with_dump_block(_merged(_runner(ref, True, 1 << 20)).geometry, SLOTS * PER_SEQ)
    shapes = set()
    for start in range(40, 56):  # 0 .. 4 windows of ratio 4 close, none of ratio 128; 3 or 4 steps of
        num_steps = 3 + start % 2  # 12 tokens (a verify batch a request joined): one shape
        lengths = [4, 4, 4] if num_steps == 3 else [3, 3, 3, 3]
        batch = ForwardBatch([SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), start + 3 * i,
                                      [1] * lengths[i], num_logits=lengths[i]) for i in range(num_steps)])  # fmt: skip
        ctx = build_context(batch, geo, device=torch.device("cpu"), batch_invariant=False)
        layout = cuda_graphs.layout(ctx)
        assert layout is not None
        shapes.add(layout.signature)
    assert len(shapes) == 1


@pytest.mark.timeout(300)
def test_padding_steps_change_no_real_row(ref):
    """A graphed runner pads a decode or verify batch of more than PAD_FROM tokens with padding
    steps (one token each, the dump slot and dump block) up to ``shape_bucket``: the real rows'
    logits equal the unpadded forward's, every real cache row and ring slot too, and a batch's
    signature on its padded token and step counts alone."""
    from types import SimpleNamespace

    from deepinfer.engine.core.cuda_graphs import shape_bucket as padded_tokens
    from deepinfer.engine.core.model_runner import PAD_FROM

    runners = []
    for _ in range(2):
        runner = _merged(_runner(ref, True, 1 << 20))
        runner.geometry = with_dump_block(runner.geometry, runner.blocks.dump_block)
        runners.append(runner)
    plain, padded = runners
    padded.graphs = SimpleNamespace(max_tokens=512)  # what _graph_batch reads of a graph runner
    rng = random.Random(5)
    pos = [0] * SLOTS
    padded_any = False
    for it in range(14):
        live = range(SLOTS) if it < 2 else sorted(rng.sample(range(SLOTS), rng.randrange(2, SLOTS + 1)))
        steps = []
        for i in live:
            n = rng.randrange(20, 120) if it < 2 else rng.choice([1, 1, rng.randrange(2, 7)])
            steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                 [rng.randrange(100) for _ in range(n)], num_logits=1 if it < 2 else n))  # fmt: skip
            pos[i] += n
        batch = ForwardBatch(steps)
        want = plain.execute(batch)
        big = padded._graph_batch(batch)
        if it >= 2 and batch.num_tokens > PAD_FROM:
            assert big.num_tokens == padded_tokens(batch.num_tokens)
            padded_any |= big is not batch
        ctx = padded._build_context(big, padded.geometry, device=torch.device("cpu"), batch_invariant=False)
        hidden = padded.model(ctx, padded.blocks, padded.swa)[: batch.num_logits]
        got = padded.model.compute_logits(hidden, False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert padded_any
    for spec in plain.blocks.specs:
        torch.testing.assert_close(padded.blocks.tensor(spec.layer, spec.name), plain.blocks.tensor(spec.layer, spec.name),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    for spec in plain.swa.specs:
        torch.testing.assert_close(padded.swa.ring(spec.layer, spec.name), plain.swa.ring(spec.layer, spec.name),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    # the padding touched the dump slot only (the plain runner never did)
    assert any(padded.swa.flat(s.layer, s.name)[SLOTS * s.capacity:].abs().sum() > 0 for s in padded.swa.specs)
    assert all(not plain.swa.flat(s.layer, s.name)[SLOTS * s.capacity:].any() for s in plain.swa.specs)
    # the signature of batches of 9..12 tokens over 2..SLOTS steps depends on the padded token
    # count and the padded step count (steps + padding steps) alone
    from deepinfer.engine.core.cuda_graphs import shape_bucket as padded_count

    sigs: dict = {}
    for n_steps in range(2, SLOTS + 1):
        for extra in range(9 - n_steps, 13 - n_steps):
            lengths = [1] * n_steps
            lengths[0] += extra
            batch = ForwardBatch([SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), 200 + 5 * i,
                                          [1] * lengths[i], num_logits=lengths[i]) for i in range(n_steps)])  # fmt: skip
            big = padded._graph_batch(batch)
            ctx = padded._build_context(big, padded.geometry, device=torch.device("cpu"), batch_invariant=False)
            sigs.setdefault((big.num_tokens, padded_count(len(big.steps))), set()).add(cuda_graphs.layout(ctx).signature)
    assert len(sigs) < 4 * 3 and all(len(v) == 1 for v in sigs.values())
