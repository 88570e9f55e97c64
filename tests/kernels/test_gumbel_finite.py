"""Gumbel noise stays finite: the top 24-bit hash value must not round its uniform up to 1.0
(-log(-log(1)) is +inf, and +inf noise on a token a grammar masked to -inf gives NaN, which the
argmax takes: a masked token sampled, the request aborted)."""

import torch

from deepinfer.engine.sample.sampler import noisy_argmax
from deepinfer.kernels.counter_rng import GumbelNoise

KEY, TOKEN, VOCAB = 2139, 3417, 4096  # a (row key, token) whose hash is 2^24 - 1


def test_uniform_stays_below_one_and_noise_finite():
    noise = GumbelNoise()
    keys = torch.arange(2000, 3000, dtype=torch.int64)
    u = noise.uniform(keys, None, VOCAB)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    assert torch.isfinite(noise.gumbel(keys, VOCAB)).all()  # the CPU block path
    ids = torch.full((1, 1), TOKEN, dtype=torch.int64)
    assert torch.isfinite(noise.gumbel(torch.tensor([KEY]), VOCAB, ids)).all()  # the gathered path


def test_a_masked_token_is_never_sampled():
    noise = GumbelNoise()
    logits = torch.zeros(1, VOCAB)
    logits[0, TOKEN] = float("-inf")  # the grammar forbids it
    g = noise.gumbel(torch.tensor([KEY]), VOCAB)
    assert int(noisy_argmax(logits, torch.ones(1), g)) != TOKEN
