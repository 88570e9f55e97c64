"""Self-consistency of the V4.1 serving path on the tiny official-layout checkpoint (float32 CPU).

Every layer role runs in these sequences: prompts long enough that ratio-2 layers select a top-k
(> index_topk pairs) and the candidate pool bites (> candidate_topk_blocks x block positions).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")

BLOCK = 16


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 480, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def runner(tiny_dir):
    return harness.load_runner(tiny_dir, num_blocks=96, num_slots=4, block_size=BLOCK)


def _logits_one_pass(runner, ids, slot=0):
    d = harness.SeqDriver(runner, blocks_per_seq=24)
    d.add(0, ids, slot=slot)
    return d.prefill([0])[0]


def test_roles_are_exercised(runner):
    c = runner.config
    assert [r.name for r in c.roles] == ["window", "window", "full", "reuse", "full", "reuse", "full", "reuse",
                                        "reindex", "reuse"]
    n = 70
    assert n // 2 > c.index_topk and n > c.candidate_topk_blocks * c.candidate_block_size


def test_incremental_decode_equals_full_recompute(runner):
    ids = _prompt(70, 1)
    full = _logits_one_pass(runner, ids)
    d = harness.SeqDriver(runner, blocks_per_seq=24)
    d.add(0, ids[:40], slot=1)
    first = d.prefill([0])[0]
    rows = [first]
    for t in ids[40:]:
        d.seqs[0].tokens.append(t)
        rows.append(d.step({0: (1, 1)})[0])
    assert torch.equal(torch.cat(rows), full)


def test_any_chunking_equals_one_pass(runner):
    ids = _prompt(90, 2)
    full = _logits_one_pass(runner, ids)
    for chunk in (7, 33):
        d = harness.SeqDriver(runner, blocks_per_seq=24)
        d.add(0, ids, slot=1)
        assert torch.equal(d.prefill([0], chunk=chunk)[0], full), chunk


def test_batched_equals_alone(runner):
    prompts = [_prompt(n, 10 + n) for n in (37, 64, 81)]
    alone = [_logits_one_pass(runner, p) for p in prompts]
    d = harness.SeqDriver(runner, blocks_per_seq=24)
    for i, p in enumerate(prompts):
        d.add(i, p, slot=i)
    together = d.prefill([0, 1, 2], chunk=29)
    for i in range(3):
        assert torch.equal(together[i], alone[i]), i
    toks, rows = d.greedy([0, 1, 2], 6, together)
    for i, p in enumerate(prompts):
        e = harness.SeqDriver(runner, blocks_per_seq=24)
        e.add(0, p, slot=3)
        t, r = e.greedy([0], 6, e.prefill([0]))
        assert t[0] == toks[i] and torch.equal(r[0], rows[i]), i


def test_prefix_hit_with_exact_replay_equals_miss(runner):
    """A second sequence reuses the first one's blocks below the hit and replays the last
    sliding_window x layers tokens into a fresh slot (window_start/write_from as the scheduler
    sets them): its logits past the hit equal a cold prefill's."""
    c = runner.config
    hit = 12 * BLOCK  # 192, a block boundary
    replay = c.sliding_window * c.num_hidden_layers  # 160 < hit: the replay starts past 0
    ids = _prompt(hit + 20, 3)
    cold = _logits_one_pass(runner, ids)
    first = harness.SeqDriver(runner, blocks_per_seq=24)
    first.add(0, ids[:hit], slot=1)
    first.prefill([0], all_logits=False)
    src = first.seqs[0].blocks[: hit // BLOCK]
    dst = list(range(48, 48 + 24))
    runner.blocks.copy_blocks(src, dst[: len(src)])
    start = hit - replay
    step = SeqStep(7, 2, dst, start, ids[start:], num_logits=len(ids) - hit, window_start=start, write_from=hit)
    warm = runner.execute(ForwardBatch([step]))
    assert torch.equal(warm, cold[hit:])


def test_bounded_decoder_replay(runner, tiny_dir):
    """Bounded replay: the decoder layers (the CED source and above) recompute only the last
    ``decoder_replay_tokens`` replayed tokens; with a bound covering the whole replay it is the
    exact replay, with a short one it is approximate but stays near it."""
    c = runner.config
    hit, replay = 12 * BLOCK, c.sliding_window * c.num_hidden_layers
    ids = _prompt(hit + 12, 4)
    first = harness.SeqDriver(runner, blocks_per_seq=24)
    first.add(0, ids[:hit], slot=1)
    first.prefill([0], all_logits=False)
    dst = list(range(48, 72))
    runner.blocks.copy_blocks(first.seqs[0].blocks[: hit // BLOCK], dst[: hit // BLOCK])
    start = hit - replay

    def replayed(bound):
        bounded = harness.load_runner(tiny_dir, num_blocks=96, num_slots=4, block_size=BLOCK)
        bounded.model.decoder_replay_tokens = bound
        bounded.geometry = bounded.model.geometry(BLOCK, 6)
        bounded.write_blocks(dst, runner.read_blocks(dst))  # the hit's blocks, as a KV tier would
        step = SeqStep(7, 2, dst, start, ids[start:], num_logits=len(ids) - hit, window_start=start, write_from=hit)
        return bounded.execute(ForwardBatch([step]))

    exact = runner.execute(ForwardBatch([SeqStep(8, 3, dst, start, ids[start:], num_logits=len(ids) - hit,
                                                 window_start=start, write_from=hit)]))
    assert torch.equal(replayed(replay), exact)
    approx = replayed(c.sliding_window)
    assert not torch.equal(approx, exact)
    top1 = (approx.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert torch.isfinite(approx).all() and top1 >= 0.5, top1


def test_pd_handoff_equals_colocated(runner, tiny_dir):
    """Prefill on one runner, hand blocks + slot to another (other block and slot ids), decode
    there: the same tokens and logits as decoding where the prefill ran."""
    ids = _prompt(75, 5)
    here = harness.SeqDriver(runner, blocks_per_seq=24)
    here.add(0, ids, slot=0)
    first = here.prefill([0], all_logits=False)
    num_blocks = -(-len(ids) // BLOCK)
    blocks = runner.read_blocks(here.seqs[0].blocks[:num_blocks])
    slot = runner.read_slot(0)
    toks_here, rows_here = here.greedy([0], 8, first)

    other = harness.load_runner(tiny_dir, num_blocks=96, num_slots=4, block_size=BLOCK)
    assert other.kv_layout() == runner.kv_layout()
    there = harness.SeqDriver(other, blocks_per_seq=24)
    there.add(0, ids, slot=3)
    other.write_blocks(there.seqs[0].blocks[:num_blocks], blocks)
    other.write_slot(3, slot)
    there.seqs[0].num_computed = len(ids)
    toks_there, rows_there = there.greedy([0], 8, first)
    assert toks_there == toks_here and torch.equal(rows_there[0], rows_here[0])


def test_fp8_fp4_checkpoint_equals_dequantised_fp32(runner, tiny_dir, tmp_path):
    """The float path on the FP8/FP4 checkpoint equals the same dequantised weights stored in fp32."""
    from deepinfer.engine.models.deepseek_v41.checkpoint_writer import save_v41_checkpoint
    from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint

    loaded = load_v41_checkpoint(tiny_dir)
    tensors = dict(loaded.tensors)
    for name in [k for k in tensors if k.endswith(".engram.embed")]:  # the table as fp32 values
        scale = tensors[name + "_scale"]
        t = tensors[name]
        tensors[name] = (t.float().view(t.shape[0], -1, 32) * scale[:, :, None]).view(t.shape)
    out = tmp_path / "fp32"
    save_v41_checkpoint(out, loaded.config, tensors, quantize=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    fp32 = harness.load_runner(out, num_blocks=96, num_slots=4, block_size=BLOCK)
    assert fp32.config.quantization is None and runner.config.quantization is not None
    ids = _prompt(60, 6)
    assert torch.equal(_logits_one_pass(fp32, ids), _logits_one_pass(runner, ids))
