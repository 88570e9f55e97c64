"""Batch invariance and chunking invariance of the serving V4 model (bitwise, CPU float32).

A sequence's logits must be identical whatever else shares its forwards (prefill chunks and
decodes of other sequences) and however its prompt is chunked.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, SeqDriver, hf_reference

BLOCK_SIZE = 16
LENGTHS = [5, 17, 40, 64, 101, 150, 203, 290]
NUM_DECODE = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["mixed_hc2", "hc4_all_kinds"])
def ref(request):
    if request.param == "mixed_hc2":
        return hf_reference(seed=1, layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)
    return hf_reference(
        seed=2, layer_types=[CSA, HCA, SLIDING], hc_mult=4, index_topk=8,
        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=16, num_experts_per_tok=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts(ref):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def new_driver(ref, num_seqs: int) -> SeqDriver:
    blocks_per_seq = -(-(max(LENGTHS) + NUM_DECODE) // BLOCK_SIZE)
    runner = ModelRunner(
        ref.config, ref.state_dict, num_blocks=num_seqs * blocks_per_seq, num_slots=num_seqs, block_size=BLOCK_SIZE
    )
    return SeqDriver(runner, blocks_per_seq)


def run_staggered(driver: SeqDriver, prompts: dict[int, list[int]], chunks: dict[int, int], starts: dict[int, int]):
    """Every step, each started sequence runs its next prefill chunk or one greedy decode, so
    forwards mix prefill chunks and decodes. Returns per sequence all logit rows and its tokens."""
    for i, p in prompts.items():
        driver.add(i, p)
    rows = {i: [] for i in prompts}
    generated = {i: 0 for i in prompts}
    step = 0
    while any(generated[i] < NUM_DECODE for i in prompts):
        plan = {}
        for i in prompts:
            s = driver.seqs[i]
            if step < starts[i] or generated[i] >= NUM_DECODE:
                continue
            left = len(s.tokens) - s.num_computed
            if left == 0:  # the last row was sampled: append the greedy token and decode it
                s.tokens.append(int(rows[i][-1][-1].argmax()))
                generated[i] += 1
                if generated[i] >= NUM_DECODE:
                    continue
                left = 1
            n = min(left, chunks[i])
            plan[i] = (n, n)
        if plan:
            for i, lg in driver.step(plan).items():
                rows[i].append(lg)
        step += 1
    return {i: torch.cat(v) for i, v in rows.items()}, {i: driver.seqs[i].tokens for i in prompts}


def test_eight_prompts_in_one_batch_match_each_alone(ref, prompts):
    seqs = dict(enumerate(prompts))
    chunks = {i: 10_000 for i in seqs}
    together, tokens = run_staggered(new_driver(ref, 8), seqs, chunks, {i: 0 for i in seqs})
    for i, p in seqs.items():
        alone, alone_tokens = run_staggered(new_driver(ref, 1), {0: p}, {0: 10_000}, {0: 0})
        assert alone_tokens[0] == tokens[i], f"prompt {i} (len {len(p)}): tokens differ in a batch"
        assert torch.equal(alone[0], together[i]), f"prompt {i} (len {len(p)}): logits differ in a batch"


def test_mixed_prefill_chunks_and_decodes_match_alone(ref, prompts):
    """Staggered starts and odd chunk sizes: forwards mix prefill chunks with decodes."""
    seqs = dict(enumerate(prompts))
    chunks = {i: [7, 33, 100, 13, 50, 9, 64, 21][i] for i in seqs}
    starts = {i: [0, 3, 1, 8, 0, 5, 2, 12][i] for i in seqs}
    together, tokens = run_staggered(new_driver(ref, 8), seqs, chunks, starts)
    for i, p in seqs.items():
        alone, alone_tokens = run_staggered(new_driver(ref, 1), {0: p}, {0: len(p)}, {0: 0})
        assert alone_tokens[0] == tokens[i], f"prompt {i}: tokens differ"
        assert torch.equal(alone[0], together[i]), f"prompt {i}: logits differ"


@pytest.mark.parametrize("chunk", [7, 33, 100])
def test_chunked_prefill_is_identical_to_one_shot(ref, prompts, chunk):
    prompt = prompts[-1]
    one = new_driver(ref, 1)
    one.add(0, prompt)
    expected = one.prefill([0])[0]
    expected_tokens, _ = one.greedy([0], 8, {0: expected})
    chunked = new_driver(ref, 1)
    chunked.add(0, prompt)
    got = chunked.prefill([0], chunk=chunk)[0]
    assert torch.equal(got, expected)
    got_tokens, _ = chunked.greedy([0], 8, {0: got})
    assert got_tokens == expected_tokens
