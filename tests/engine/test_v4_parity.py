"""Our serving DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (float32, CPU).

Four tiny random configs mix window-only, CSA and HCA layers, hash and learned routing and
hc_mult 1-4; window 8-16 and ratios 2-16 so 200-400-token prompts cross many window and
compression boundaries, with index_topk well below the number of compressed entries.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import (
    CSA,
    PARITY_CONFIGS,
    PARITY_PROMPT_LENGTHS,
    SeqDriver,
    hf_greedy,
    hf_prompt_logprobs,
    hf_reference,
)

CONFIGS, PROMPT_LENGTHS = PARITY_CONFIGS, PARITY_PROMPT_LENGTHS
BLOCK_SIZE = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request):
    name = request.param
    ref = hf_reference(seed=len(name), **CONFIGS[name])
    ref.hf_model.generation_config.eos_token_id = None  # never stop early: compare all 64 tokens
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ref.config.vocab_size, (PROMPT_LENGTHS[name],), generator=g).tolist()
    return name, ref, prompt


def make_driver(ref, max_len: int) -> SeqDriver:
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    runner = ModelRunner(ref.config, ref.state_dict, num_blocks=2 * blocks_per_seq, num_slots=2, block_size=BLOCK_SIZE)
    return SeqDriver(runner, blocks_per_seq)


def test_configs_exercise_compression(case):
    name, ref, prompt = case
    c = ref.config
    ratios = {c.compress_ratio(i) for i in range(c.num_hidden_layers)} - {0}
    assert ratios, name
    for r in ratios:
        assert len(prompt) // r > 2 * c.sliding_window // r  # many closed windows beyond the SWA
    if any(t == CSA for t in c.layer_types):
        assert len(prompt) // c.compress_rates[CSA] > 4 * c.index_topk


def test_prompt_logprobs_match_transformers(case):
    name, ref, prompt = case
    driver = make_driver(ref, len(prompt))
    driver.add(0, prompt)
    logits = driver.prefill([0])[0]
    ours = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    theirs = hf_prompt_logprobs(ref.hf_model, prompt)
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logprob diff| {diff:.2e}"
    assert theirs.std() > 0.1  # the reference is not degenerate


def test_greedy_continuation_matches_transformers_generate(case):
    name, ref, prompt = case
    num_new = 64
    expected = hf_greedy(ref.hf_model, prompt, num_new)
    assert len(expected) == num_new
    driver = make_driver(ref, len(prompt) + num_new)
    driver.add(0, prompt)
    first = driver.prefill([0], all_logits=False)
    tokens, _ = driver.greedy([0], num_new, first)
    assert tokens[0] == expected, f"{name}: first mismatch at {next(i for i, (a, b) in enumerate(zip(tokens[0], expected)) if a != b)}"
    assert len(set(expected)) > 8  # a real continuation, not one token repeated
