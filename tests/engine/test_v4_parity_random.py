"""Random tiny DeepSeek-V4 checkpoints through the whole loader path against transformers.

Per drawn config (engine/models/deepseek_v4/testing.py ``random_overrides``, fixed seed):
transformers 5.23 ``DeepseekV4ForCausalLM`` with weights that exercise every path ->
``save_pretrained`` + the tiny tokenizer into a temp dir -> ``LLM(model=dir, dtype="float32",
device="cpu")``; a long prompt (across window and compression boundaries) and a short one in one
batch, sometimes in chunked prefill. Prompt logprobs within 1e-4 and 6 greedy tokens identical.
CI checks 20 configs; ``DEEPINFER_PARITY_CONFIGS=200`` searches longer.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine.models.deepseek_v4.testing import hf_greedy, hf_prompt_logprobs, hf_reference, random_overrides
from deepinfer.engine.text.tiny_tokenizer import build_tokenizer, write_tokenizer_files

SEED = 1017
NUM_NEW = 6
# random_overrides draws vocab sizes up to 640; a tokenizer with fewer ids than the model
# cannot detokenize every id the model may emit
TOKENIZER_VOCAB = 640

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER_VOCAB)


def draw_case(index: int) -> tuple[dict, list[list[int]], int]:
    """(config overrides, prompts, max_num_batched_tokens) of case ``index``: the same for any count."""
    rng = random.Random(f"{SEED}-{index}")
    overrides = random_overrides(rng)
    vocab, longest_ratio = overrides["vocab_size"], overrides["compress_rates"]["heavily_compressed_attention"]
    lengths = (rng.randint(max(longest_ratio, 64) + 8, 260), rng.randint(1, 12))
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    chunk = rng.choice((32768, rng.randint(16, 100)))
    return overrides, prompts, chunk


def assert_loaded_checkpoint_matches(tmp_path, tokenizer, seed: int, overrides: dict, prompts: list[list[int]],
                                     chunk: int, case: str) -> None:
    ref = hf_reference(seed=seed, **overrides)
    hf = ref.hf_model
    hf.generation_config.eos_token_id = None  # never stop early: compare every token
    assert ref.config.vocab_size <= TOKENIZER_VOCAB
    hf.save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path, tokenizer, model_max_length=4096)

    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=2,
              max_num_batched_tokens=chunk)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()

    case = f"{case} chunk={chunk} lengths={[len(p) for p in prompts]} {overrides}"
    for out, prompt in zip(outs, prompts):
        assert out.prompt_token_ids == prompt
        if len(prompt) > 1:
            theirs = hf_prompt_logprobs(hf, prompt)
            ours = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])
            diff = (ours - theirs).abs()
            first = int((diff > 1e-4).nonzero()[0]) if diff.max() > 1e-4 else None
            assert first is None, f"{case}: |logprob diff| {diff.max():.2e}, first > 1e-4 at position {first}"
            assert len(prompt) < 20 or theirs.std() > 0.05, case  # the reference is not degenerate
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_NEW), case


@pytest.mark.parametrize("index", range(envs.get().parity_configs), ids=lambda i: f"cfg{i}")
def test_random_checkpoint_matches_transformers(index, tmp_path, tokenizer):
    overrides, prompts, chunk = draw_case(index)
    assert_loaded_checkpoint_matches(tmp_path, tokenizer, index, overrides, prompts, chunk, f"cfg{index}")


@pytest.mark.parametrize("rank", [8, 10, 12, 20, 24])
def test_grouped_output_projection_with_a_rank_off_the_gemm_panel(rank, tmp_path, tokenizer):
    """Regression: with o_groups > 1 and o_lora_rank not a multiple of the native GEMM's
    16-column panel, every group after the first read the wrong packed o_a weights (logprobs
    off by ~1 from position 0, no greedy token right)."""
    rng = random.Random(rank)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (90, 7)]
    assert_loaded_checkpoint_matches(tmp_path, tokenizer, rank, dict(o_groups=2, o_lora_rank=rank), prompts, 32768,
                                     f"o_lora_rank={rank}")  # fmt: skip
