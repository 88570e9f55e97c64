"""V4.1 with compact token-group candidates (``Geometry.compact_candidates``, what a model off the
CPU builds): the same logits as the full form, through prefill chunks of mixed lengths (groups whose
tokens share one candidate row, others with a row per token) and decodes, the candidate pool and
the shared picks of the kv / index sources included."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")
PER_SEQ = 24  # blocks of 16 per sequence


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41") / "m"
    harness.write_tiny_v41(path, seed=0, **harness.TEST_SIZES)
    return path


def _runner(model_dir, compact: bool, max_rows: int):
    runner = harness.load_runner(model_dir, num_blocks=3 * PER_SEQ, num_slots=3, block_size=16)
    base = dataclasses.replace(runner.geometry.base, compact_candidates=compact, max_group_key_rows=max_rows)
    runner.geometry = dataclasses.replace(runner.geometry, base=base)
    return runner


def _chunked_logits(runner, seed: int = 1, on_batch=None):
    """Logits of four prefill chunks of mixed lengths, then decodes, for 3 sequences;
    ``on_batch(batch)`` sees each batch before it runs."""
    rng = random.Random(seed)
    pos, logits = [0] * 3, []
    for it in range(7):
        steps = []
        for i in range(3):
            n = rng.randrange(1, 100) if it < 4 else 1
            steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                 [rng.randrange(50, 400) for _ in range(n)], num_logits=1))  # fmt: skip
            pos[i] += n
        batch = ForwardBatch(steps)
        if on_batch is not None:
            on_batch(batch)
        logits.append(runner.execute(batch).float().cpu())
    return torch.cat(logits)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_rows", [300, 1 << 17])
def test_v41_forward_with_compact_candidates_equals_the_full_form(model_dir, max_rows):
    outs, shared = {}, [0]
    for compact in (False, True):
        runner = _runner(model_dir, compact, max_rows)
        assert runner.geometry.base.compact_candidates is compact

        def count_shared(batch, runner=runner):
            ctx = runner._build_context(batch, runner.geometry, device=torch.device("cpu"), batch_invariant=False)
            for plan in ctx.compress.values():
                for g in plan.groups:
                    g.expand_candidates()
                    shared[0] += g.shared_rows

        outs[compact] = _chunked_logits(runner, on_batch=count_shared if compact else None)
    assert shared[0] > 0  # the shared-row path (one gather per group) ran
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pad", [False, True])
def test_v41_merged_decode_groups_equal_split_groups(model_dir, pad):
    """One token group per layer kind for decode steps (``Geometry.merge_step_tokens``, what a
    model off the CPU builds): the decodes' logits within float32 rounding of per-shape groups',
    the same greedy tokens; the merged decodes hold one group per kind. ``pad``: the merged
    runner also pads its closing entries into the dump block (a runner replaying CUDA graphs)."""
    from deepinfer.engine.core.model_runner import with_dump_block
    from deepinfer.engine.models.deepseek_v4.context import MERGE_STEP_TOKENS

    outs, groups = {}, {False: [], True: []}
    for merge in (False, True):
        runner = _runner(model_dir, True, 1 << 20)
        if merge:
            base = dataclasses.replace(runner.geometry.base, merge_step_tokens=MERGE_STEP_TOKENS)
            runner.geometry = dataclasses.replace(runner.geometry, base=base)
            if pad:
                runner.geometry = with_dump_block(runner.geometry, runner.blocks.dump_block)
                assert runner.geometry.base.dump_block == runner.blocks.dump_block

        def count_groups(batch, runner=runner, seen=groups[merge]):
            if all(s.num_tokens == 1 for s in batch.steps):
                ctx = runner._build_context(batch, runner.geometry, device=torch.device("cpu"), batch_invariant=False)
                seen.append(max(len(plan.groups) for plan in ctx.compress.values()))

        logits, pos, rng = [], [0, 0, 0], random.Random(2)
        for it in range(5):  # sequence 0 closes no entry yet, 1 and 2 many: different key-set shapes
            steps = []
            for i in range(3):
                n = ((1, 150, 290)[i] if it == 0 else 1)
                steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                     [rng.randrange(50, 400) for _ in range(n)], num_logits=1))  # fmt: skip
                pos[i] += n
            batch = ForwardBatch(steps)
            count_groups(batch)
            logits.append(runner.execute(batch).float().cpu())
        outs[merge] = torch.cat(logits)
    assert max(groups[False]) > 1 and max(groups[True]) == 1  # the sequences' shapes differ; merged: one
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[True].argmax(-1), outs[False].argmax(-1))


@pytest.mark.timeout(300)
def test_v41_padding_steps_change_no_real_row(model_dir):
    """V4.1 (Engram rings, the DSpark features) through a graphed runner's padded batches
    (``graph_batch``: padding steps on the dump slot and block, padded entries and step pools):
    the real rows' logits equal the unpadded forward's, and every real ring slot."""
    from deepinfer.engine.core.model_runner import graph_batch, with_dump_block
    from deepinfer.engine.models.deepseek_v4.context import MERGE_STEP_TOKENS

    runners = []
    for _ in range(2):
        runner = _runner(model_dir, True, 1 << 20)
        base = dataclasses.replace(runner.geometry.base, merge_step_tokens=MERGE_STEP_TOKENS)
        runner.geometry = with_dump_block(dataclasses.replace(runner.geometry, base=base), runner.blocks.dump_block)
        runners.append(runner)
    plain, padded = runners
    rng, pos, grew = random.Random(4), [0, 0, 0], 0
    for it in range(8):
        live = range(3) if it == 0 else sorted(rng.sample(range(3), rng.randrange(2, 4)))
        steps = []
        for i in live:
            n = (1, 150, 290)[i] if it == 0 else rng.choice([1, rng.randrange(2, 7)])
            steps.append(SeqStep(i, i, list(range(i * PER_SEQ, (i + 1) * PER_SEQ)), pos[i],
                                 [rng.randrange(50, 400) for _ in range(n)], num_logits=1 if it == 0 else n))  # fmt: skip
            pos[i] += n
        batch = ForwardBatch(steps)
        want = plain.execute(batch).float()
        big = graph_batch(batch, padded.geometry, padded.swa.dump_slot, padded.blocks.dump_block, 512)
        grew += big is not batch
        ctx = padded._build_context(big, padded.geometry, device=torch.device("cpu"), batch_invariant=False)
        hidden = padded.model(ctx, padded.blocks, padded.swa)[: batch.num_logits]
        got = padded.model.compute_logits(hidden, False).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert grew
    for spec in plain.swa.specs:
        # float32 rounding: the projections ran over another row count
        torch.testing.assert_close(padded.swa.ring(spec.layer, spec.name), plain.swa.ring(spec.layer, spec.name),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_v41_on_cuda_compact_matches_the_cpu_full_form(model_dir):
    """Off the CPU the geometry is compact and the kernels run; float32 logits within 1e-3 of the
    CPU's full form, through prefill chunks and decodes (graphs off: the eager kernels path)."""
    cpu = _runner(model_dir, compact=False, max_rows=1 << 17)
    cuda = harness.load_runner(model_dir, num_blocks=3 * PER_SEQ, num_slots=3, block_size=16, device="cuda",
                               dtype=torch.float32, cuda_graphs=False)  # fmt: skip
    assert cuda.geometry.base.compact_candidates and not cpu.geometry.base.compact_candidates
    torch.testing.assert_close(_chunked_logits(cuda), _chunked_logits(cpu), rtol=1e-3, atol=1e-3)
