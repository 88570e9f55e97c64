"""Parity of the V4.1 serving path with a plain, cache-free reference forward (plain_v41.py).

Teacher-forced: the serving path prefills a prompt and decodes 32 greedy tokens step by step
(its caches, its chunking); the reference recomputes the whole sequence in one pass from the
checkpoint. Realised-token logprobs must agree within 1e-3 and the top-1 token at >= 99 % of
positions.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")
plain = load_test_helper("engine/v41/plain_v41")

NUM_NEW = 32


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return plain.PlainV41(tiny_dir)


@pytest.mark.parametrize("prompt_len, chunk, seed", [(80, None, 0), (120, 37, 1)])
def test_serving_path_matches_plain_reference(tiny_dir, reference, prompt_len, chunk, seed):
    runner = harness.load_runner(tiny_dir, num_blocks=64, num_slots=2, block_size=16)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 480, (prompt_len,), generator=g).tolist()
    d = harness.SeqDriver(runner, blocks_per_seq=16)
    d.add(0, prompt)
    first = d.prefill([0], chunk=chunk)[0]
    new, rows = d.greedy([0], NUM_NEW, {0: first})
    seq = prompt + new[0]
    served = torch.log_softmax(torch.cat([first[:-1], rows[0]]), -1)  # predictions of seq[1:]
    ref = torch.log_softmax(reference.logits(seq)[:-1], -1)
    target = torch.tensor(seq[1:])[:, None]
    realised = (served.gather(1, target) - ref.gather(1, target)).abs()
    top1 = (served.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert realised.max().item() < 1e-3, realised.max().item()
    assert top1 >= 0.99, top1
