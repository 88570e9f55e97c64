"""Speculative verification keeps the sampled output distribution: chi-square on 20,000 draws.

The engine verifies a request's drafts with the sampler's own rows (engine/sample/: one
SampleRow per verified position, the counter-based draw of (seed, position)) and
``verify_drafts``: accept while each draft equals the draw, then the draw itself. For a
deterministic drafter that is standard speculative rejection sampling (accept d with
probability p(d), else a token from p without d). This test runs that exact code over a
Markov-chain "model" with a 5-token vocabulary (row logits ``A[previous token]``, sampled at
temperature 0.9 with top-p 0.95) and a greedy drafter from a different matrix: 20,000 seeds
draw three tokens with speculation (3 drafts, then plain steps past the first rejection) and
20,000 other seeds draw them without. The joint distribution of the three tokens (125 cells)
matches between the two runs (two-sample chi-square) and matches the exact product of the
chain's probabilities (goodness of fit), p > 0.01 each. With the same seeds the two runs give
the same tokens, draw for draw (the coupling that makes DSpark outputs independent of it).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chi2_contingency, chisquare

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sample.metadata import SampleRow, SamplingMetadata
from deepinfer.engine.sample.sampler import Sampler, apply_top_k_top_p, verify_drafts

V, DRAFTS, LENGTH, ROOT, POSITION = 5, 3, 3, 2, 17
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=LENGTH)
g = torch.Generator().manual_seed(0)
TARGET = torch.randn(V, V, generator=g) * 2.5  # logits of the next token given the previous one
DRAFTER = TARGET + torch.randn(V, V, generator=g) * 0.5  # a drafter that is often, not always, right


def sample(sampler: Sampler, prev: torch.Tensor, seeds: np.ndarray, position: np.ndarray) -> torch.Tensor:
    """One draw per row from the target given each row's previous token."""
    rows = [SampleRow(PARAMS, int(s), int(p)) for s, p in zip(seeds, position)]
    return sampler(TARGET[prev], SamplingMetadata.build(rows, V)).token_ids


def without_speculation(seeds: np.ndarray) -> np.ndarray:
    sampler, prev, out = Sampler(), torch.full((len(seeds),), ROOT), []
    for k in range(LENGTH):
        prev = sample(sampler, prev, seeds, np.full(len(seeds), POSITION + k))
        out.append(prev)
    return torch.stack(out, dim=1).numpy()


def with_speculation(seeds: np.ndarray) -> np.ndarray:
    n, sampler = len(seeds), Sampler()
    drafts, prev = [], torch.full((n,), ROOT)
    for _ in range(DRAFTS):  # the greedy draft chain
        prev = DRAFTER[prev].argmax(dim=-1)
        drafts.append(prev)
    drafts = torch.stack(drafts, dim=1)
    contexts = torch.cat([torch.full((n, 1), ROOT), drafts], dim=1)  # row k assumes drafts[:k] accepted
    rows = [SampleRow(PARAMS, int(s), POSITION + k) for s in seeds for k in range(DRAFTS + 1)]
    sampled = sampler(TARGET[contexts.reshape(-1)], SamplingMetadata.build(rows, V)).token_ids.view(n, -1)
    accepted = [verify_drafts(sampled[i].tolist(), drafts[i].tolist()) for i in range(n)]
    out = np.zeros((n, LENGTH), dtype=np.int64)
    for i, toks in enumerate(accepted):
        out[i, : min(len(toks), LENGTH)] = toks[:LENGTH]
    # past the first rejection: plain steps, as the engine's next steps would be
    have = np.array([len(t) for t in accepted])
    for k in range(LENGTH):
        todo = np.nonzero(have <= k)[0]
        if len(todo):
            prev = torch.from_numpy(out[todo, k - 1]) if k else torch.full((len(todo),), ROOT)
            out[todo, k] = sample(sampler, prev, seeds[todo], np.full(len(todo), POSITION + k)).numpy()
    return out, np.array([len(t) - 1 for t in accepted])


def exact_probabilities() -> np.ndarray:
    probs = torch.softmax(apply_top_k_top_p(TARGET / PARAMS.temperature, None, torch.full((V,), PARAMS.top_p)), -1)
    p = probs.numpy().astype(np.float64)
    joint = np.einsum("a,ab,bc->abc", p[ROOT], p, p)
    joint = joint.reshape(-1)
    return joint / joint.sum()


def cells(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2], minlength=V**3)


def test_sampled_distribution_is_the_same_with_and_without_drafts():
    n = 20_000
    spec, num_accepted = with_speculation(np.arange(n))
    plain = without_speculation(np.arange(n, 2 * n))
    assert 0.2 < num_accepted.mean() < DRAFTS - 0.2  # drafts are accepted and rejected: both paths run
    a, b = cells(spec), cells(plain)
    seen = (a + b) > 0
    p_two = chi2_contingency(np.stack([a[seen], b[seen]]))[1]
    expected = exact_probabilities()
    common = expected * n >= 5  # goodness of fit over the cells with enough mass; the rest pooled
    pooled_obs = lambda c: np.append(c[common], c[~common].sum())  # noqa: E731
    pooled_exp = np.append(expected[common], expected[~common].sum()) * n
    pooled_exp *= n / pooled_exp.sum()  # float32 probabilities: exact totals for scipy's check
    p_spec = chisquare(pooled_obs(a), pooled_exp)[1]
    p_plain = chisquare(pooled_obs(b), pooled_exp)[1]
    assert min(p_two, p_spec, p_plain) > 0.01, (p_two, p_spec, p_plain)


def test_same_seeds_give_the_same_tokens_with_and_without_drafts():
    seeds = np.arange(5_000) * 7 + 3
    spec, _ = with_speculation(seeds)
    assert np.array_equal(spec, without_speculation(seeds))
