"""The cache-free training forward (dense_forward.py) computes what the serving engine computes.

Same checkpoint, same tokens: the engine (LLM: block cache, SWA slots, chunked prefill, its native
CPU kernels) and the autograd forward give the same prompt logprobs and the same top-1 token at
every position, with compressed KV, index top-k, the candidate pool and Engram all in play
(prompts several sliding windows long). Also: every trained tensor gets a gradient, and the
DSpark drafter's block attention is non-causal inside the block and reads only its valid context.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward, logits
from deepinfer.engine.models.deepseek_v41.dspark import DSparkDrafter, context_windows
from deepinfer.engine.models.deepseek_v41.training.model_setup import trainable
from deepinfer.engine.models.deepseek_v41.training.run import load_for_eval

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16, max_num_seqs=4)


def engine_prompt_logprobs(model_dir, prompt: list[int]) -> tuple[list[float], list[int]]:
    """(logprob of each prompt token 1.., top-1 token predicted after each position 0..n-2)."""
    llm = LLM(model=str(model_dir), **OPTIONS)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))[0]
    realised = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    top1 = [max(pl.items(), key=lambda kv: kv[1].logprob)[0] for pl in out.prompt_logprobs[1:]]
    return realised, top1


def assert_dense_matches_engine(model_dir, prompt: list[int]) -> None:
    model = load_for_eval(model_dir, "cpu")
    with torch.no_grad():
        logp = torch.log_softmax(logits(model, dense_forward(model, torch.tensor([prompt])).hidden)[0], -1)
    realised, top1 = engine_prompt_logprobs(model_dir, prompt)
    dense = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert (torch.tensor(realised) - dense).abs().max().item() < 1e-3
    agree = (torch.tensor(top1) == logp[:-1].argmax(-1)).float().mean().item()
    assert agree >= 0.99, agree


def test_dense_forward_equals_the_engine_on_the_tiny_checkpoint(tiny_dir):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 480, (150,), generator=g).tolist()  # ~9 windows of 16: every role selects
    assert_dense_matches_engine(tiny_dir, prompt)


def test_every_trained_tensor_gets_a_gradient(tiny_dir):
    model = load_for_eval(tiny_dir, "cpu")
    tensors = trainable(model)
    for t in tensors.values():
        t.requires_grad_(True)
    ids = torch.randint(3, 480, (2, 60), generator=torch.Generator().manual_seed(1))
    out = dense_forward(model, ids, features=True, index_kl=True)
    drafter = DSparkDrafter(model)
    main_x = drafter.inject(out.features)
    ctx = drafter.context_kv(main_x, torch.arange(60)[None].expand(2, -1))
    anchors = torch.tensor([[20, 40], [10, 50]])
    seq = torch.tensor([0, 0, 1, 1])
    window, valid = context_windows(60, anchors.reshape(-1), model.config.sliding_window)
    slots = anchors.reshape(-1, 1) + 1 + torch.arange(drafter.block_size)[None]
    prev = ids[seq[:, None], slots]
    h = drafter.block(drafter.block_ids(prev[:, 0]), slots, ctx[:, seq[:, None], window], valid)
    loss = logits(model, out.hidden).logsumexp(-1).mean() + out.index_kl + \
        (drafter.base_logits(h) + drafter.markov_bias(prev)).logsumexp(-1).mean() + \
        drafter.confidence_logits(h, prev).mean()
    loss.backward()
    missing = [name for name, t in tensors.items() if t.grad is None or not bool(t.grad.abs().sum() > 0)]
    assert not missing, missing


@pytest.fixture(scope="module")
def drafter_setup(tiny_dir):
    model = load_for_eval(tiny_dir, "cpu")
    drafter = DSparkDrafter(model)
    ids = torch.randint(3, 480, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = dense_forward(model, ids, features=True)
        ctx = drafter.context_kv(drafter.inject(out.features), torch.arange(48)[None])
    return model, drafter, ids, ctx


def _block(drafter, ids, ctx, anchor: int, block: list[int], valid_from: int = 0):
    window, valid = context_windows(ids.shape[1], torch.tensor([anchor]), drafter.config.sliding_window)
    valid = valid & (window >= valid_from)
    slots = anchor + 1 + torch.arange(drafter.block_size)[None]
    with torch.no_grad():
        return drafter.block(torch.tensor([block]), slots, ctx[:, [0]][:, :, window[0]], valid)[0]


def test_drafter_block_is_non_causal_and_reads_only_valid_context(drafter_setup):
    _, drafter, ids, ctx = drafter_setup
    k = drafter.block_size
    base = [int(ids[0, 31])] + [drafter.noise_id] * (k - 1)
    h = _block(drafter, ids, ctx, 30, base)
    later = list(base)
    later[-1] = 7  # a later slot changes an earlier slot's hidden state: no causal mask in the block
    assert not torch.allclose(_block(drafter, ids, ctx, 30, later)[0], h[0])
    # context rows outside the valid window are not read
    hidden_ctx = ctx.clone()
    window, _ = context_windows(ids.shape[1], torch.tensor([30]), drafter.config.sliding_window)
    first_valid = int(window[0, 0]) + 3
    hidden_ctx[:, 0, : first_valid] = torch.randn_like(hidden_ctx[:, 0, : first_valid])
    assert torch.equal(_block(drafter, ids, hidden_ctx, 30, base, valid_from=first_valid),
                       _block(drafter, ids, ctx, 30, base, valid_from=first_valid))
    assert not torch.allclose(_block(drafter, ids, hidden_ctx, 30, base), h)  # ... and valid ones are


def test_draft_chain_feeds_each_draft_to_the_markov_head(drafter_setup):
    _, drafter, ids, ctx = drafter_setup
    h = _block(drafter, ids, ctx, 30, [int(ids[0, 31])] + [drafter.noise_id] * (drafter.block_size - 1))[None]
    d = drafter.draft(h, ids[0, 31:32])
    base = drafter.base_logits(h)
    prev = ids[0, 31:32]
    for k in range(drafter.block_size):
        want = (base[:, k] + drafter.markov_bias(prev)).argmax(-1)
        assert torch.equal(d.tokens[:, k], want)
        assert torch.allclose(d.logits[:, k], drafter.confidence_logits(h[:, k], prev))
        prev = want
    assert torch.allclose(d.confidence, torch.sigmoid(d.logits))
