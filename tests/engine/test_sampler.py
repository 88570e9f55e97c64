from __future__ import annotations

import torch
import xgrammar as xgr

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sample.metadata import SampleRow, SamplingMetadata
from deepinfer.engine.sample.sampler import Sampler, apply_token_bitmask
from deepinfer.kernels.counter_rng import GumbelNoise, mix32, mix32_tensor, row_key

V = 50


def meta(rows, bitmask=None):
    return SamplingMetadata.build(rows, V, bitmask=bitmask)


def rows_for(params, n, seed=3, start=0):
    return [SampleRow(params, seed=seed, position=start + i) for i in range(n)]


def test_mix32_tensor_matches_scalar():
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789]
    t = mix32_tensor(torch.tensor(xs, dtype=torch.int64))
    assert t.tolist() == [mix32(x) for x in xs]
    assert len({row_key(1, 5), row_key(1, 6), row_key(2, 5), row_key(2**32 + 1, 5), row_key(1, 2**32 + 5)}) == 5
    assert row_key(2**64 + 7, 5) == row_key(7, 5)  # seeds are taken mod 2^64


def test_greedy_is_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, meta(rows_for(SamplingParams(temperature=0.0), 6)))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_batch_invariance_and_determinism():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=gen)
    params = [
        SamplingParams(temperature=0.8, seed=i, top_k=10 if i % 3 == 0 else 0, top_p=0.9 if i % 2 else 1.0,
                       min_p=0.05 if i % 5 == 0 else 0.0, logprobs=3, frequency_penalty=0.5 if i % 4 == 0 else 0.0)
        for i in range(12)
    ] + [SamplingParams(temperature=0.0, logprobs=2)] * 4
    rows = [SampleRow(p, seed=100 + i, position=7 * i, prompt_token_ids=[1, 2], output_token_ids=[3, 3, i])
            for i, p in enumerate(params)]
    sampler = Sampler()
    full = sampler(logits, meta(rows))
    perm = torch.randperm(16, generator=gen)
    shuffled = sampler(logits[perm], meta([rows[i] for i in perm.tolist()]))
    assert shuffled.token_ids.tolist() == full.token_ids[perm].tolist()
    assert torch.equal(shuffled.logprobs.token_logprobs, full.logprobs.token_logprobs[perm])
    for i in range(16):  # each row alone
        alone = sampler(logits[i : i + 1], meta([rows[i]]))
        assert alone.token_ids.item() == full.token_ids[i].item()
        assert torch.equal(alone.logprobs.top_ids[0, : rows[i].params.logprobs],
                           full.logprobs.top_ids[i, : rows[i].params.logprobs])
    again = Sampler()(logits, meta(rows))
    assert torch.equal(again.token_ids, full.token_ids)


def test_samples_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    probs = (logits / 0.8).softmax(-1)
    rows = [SampleRow(SamplingParams(temperature=0.8), seed=42, position=i) for i in range(n)]
    out = Sampler()(logits.expand(n, -1), SamplingMetadata.build(rows, 6))
    freq = torch.bincount(out.token_ids, minlength=6).float() / n
    assert torch.max(torch.abs(freq - probs)).item() < 0.012
    # chi-square against the expected counts (5 dof; 99.9 % quantile is 20.5)
    chi2 = ((freq * n - probs * n) ** 2 / (probs * n)).sum().item()
    assert chi2 < 20.5
    # different seeds give different streams
    other = Sampler()(logits.expand(200, -1), SamplingMetadata.build(
        [SampleRow(SamplingParams(temperature=0.8), seed=43, position=i) for i in range(200)], 6))
    assert not torch.equal(other.token_ids, out.token_ids[:200])


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.linspace(3, -3, V).unsqueeze(0).expand(3000, -1)
    probs = logits[0].softmax(-1)
    cases = {
        "top_k": (SamplingParams(temperature=1.0, top_k=5), set(range(5))),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.5),
                  set(range(int((probs.cumsum(0) - probs < 0.5).sum())))),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.3), {i for i in range(V) if probs[i] >= 0.3 * probs[0]}),
    }
    for name, (p, allowed) in cases.items():
        out = Sampler()(logits, meta(rows_for(p, 3000)))
        got = set(out.token_ids.tolist())
        assert got <= allowed, name
        assert len(got) == len(allowed), name  # every allowed token shows up over 3000 draws


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    base = dict(temperature=0.0)
    r = SampleRow(SamplingParams(repetition_penalty=2.0, **base), seed=0, position=0,
                  prompt_token_ids=[0], output_token_ids=[2])
    m = SamplingMetadata.build([r], 4)
    work = logits.clone()
    from deepinfer.engine.sample.sampler import apply_penalties
    apply_penalties(work, m.penalties)
    assert work.tolist() == [[1.0, 1.0, -2.0, 0.5]]
    r = SampleRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, **base), seed=0, position=0,
                  output_token_ids=[0, 0, 1])
    m = SamplingMetadata.build([r], 4)
    work = logits.clone()
    apply_penalties(work, m.penalties)
    assert work.tolist() == [[2.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25, -1.0, 0.5]]
    # strong enough frequency penalty flips the greedy choice
    r = SampleRow(SamplingParams(frequency_penalty=2.0, **base), seed=0, position=0, output_token_ids=[0])
    assert Sampler()(logits, SamplingMetadata.build([r], 4)).token_ids.item() == 1


def test_suppressed_tokens_never_sampled():
    logits = torch.zeros(500, V)
    logits[:, 7] = 5.0
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=1, position=i, suppress_token_ids=[7, 8]) for i in range(500)]
    out = Sampler()(logits, meta(rows))
    assert not ({7, 8} & set(out.token_ids.tolist()))


def test_bitmask_matches_xgrammar_layout():
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (V + 31) // 32), dtype=torch.int32, generator=gen)
    ours = torch.randn(4, V, generator=gen)
    ref = ours.clone()
    apply_token_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    rows = rows_for(SamplingParams(temperature=1.0), 4)
    logits = torch.randn(4, V, generator=gen)
    out = Sampler()(logits, meta(rows, bitmask=bitmask))
    for i, t in enumerate(out.token_ids.tolist()):
        assert (bitmask[i, t // 32].item() >> (t % 32)) & 1


def test_logprobs_top_and_rank():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    r = SampleRow(SamplingParams(temperature=0.0, logprobs=2), seed=0, position=0, suppress_token_ids=[1])
    out = Sampler()(logits, SamplingMetadata.build([r], 5))
    lp = logits.log_softmax(-1)[0]
    assert out.token_ids.item() == 3  # token 1 suppressed
    assert out.logprobs.top_ids[0].tolist() == [1, 3]  # raw logprobs: before suppression
    assert torch.allclose(out.logprobs.top_logprobs[0], lp[[1, 3]])
    assert out.logprobs.token_ranks.item() == 2
    assert torch.allclose(out.logprobs.token_logprobs, lp[[3]])


def test_gumbel_noise_is_uniform_per_token():
    noise = GumbelNoise()
    keys = torch.tensor([row_key(9, p) for p in range(2000)], dtype=torch.int64)
    u = noise.uniform(keys, None, 64)
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert torch.all(torch.abs(hist - 0.1) < 0.01)
    # gathered noise equals the full row's noise at those token ids
    ids = torch.tensor([[5, 9, 63]] * 2000)
    assert torch.equal(noise.uniform(keys, ids, 64), u.gather(1, ids))


def test_consecutive_positions_are_independent():
    """Joint frequencies of (token at t, token at t+1) match the product distribution."""
    logits = torch.tensor([0.5, 0.0, -0.3])
    probs = logits.softmax(-1)
    n = 30000
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=7, position=i) for i in range(n)]
    toks = Sampler()(logits.expand(n, -1), SamplingMetadata.build(rows, 3)).token_ids
    pairs = torch.bincount(toks[:-1] * 3 + toks[1:], minlength=9).float()
    expected = torch.outer(probs, probs).flatten() * (n - 1)
    chi2 = ((pairs - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9  # 8 dof, 99.95 % quantile


def test_top_k_candidate_path_equals_full_vocabulary_path():
    from deepinfer.engine.sample.sampler import apply_top_k_top_p

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, V, generator=gen) * 3
    rows = [SampleRow(SamplingParams(temperature=0.7, top_k=1 + i % 12, top_p=0.8 if i % 2 else 1.0), seed=5, position=i)
            for i in range(64)]
    m = meta(rows)
    got = Sampler()(logits, m).token_ids
    full = apply_top_k_top_p(logits / 0.7, m.top_k, m.top_p)
    want = (full + GumbelNoise().gumbel(m.keys, V)).argmax(-1)
    assert torch.equal(got, want)


def test_fast_paths_match_the_reference_forms():
    """numpy argmax, vectorised keys, uint32 hashing and RowSpec metadata: same bits as the
    torch/per-row forms they replace."""
    from deepinfer.engine.sample.metadata import RowSpec
    from deepinfer.engine.sample.sampler import argmax_rows
    from deepinfer.kernels.counter_rng import M32, row_keys, seed_key

    x = torch.randn(7, V, generator=torch.Generator().manual_seed(3))
    x[1, 5] = x[1, 9] = x[1].max() + 1  # tie: the first index wins, as in torch
    x[2, 4] = float("nan")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    seeds, positions = [0, 5, 2**64 - 1, 2**40 + 3], [0, 7, 2**32 - 1, 2**33 + 11]
    assert row_keys([seed_key(s) for s in seeds], positions).tolist() == [row_key(s, p) for s, p in zip(seeds, positions)]
    keys = torch.tensor([row_key(s, p) for s, p in zip(seeds, positions)])
    th = GumbelNoise().token_hash(V, keys.device)
    h = mix32_tensor(keys.unsqueeze(1) ^ th.unsqueeze(0))
    want = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # the int64 torch form
    assert torch.equal(GumbelNoise().uniform(keys, None, V), want) and bool((h <= M32).all())

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05)]
    for subset in (params[:1], params):
        rows = [SampleRow(p, seed=11 + i, position=3 + i) for i, p in enumerate(subset)]
        specs = [RowSpec.of(r.params, r.seed, V) for r in rows]
        fast = SamplingMetadata.from_plain(specs, [r.position for r in rows])
        ref = SamplingMetadata.build(rows, V)
        assert fast.all_greedy == ref.all_greedy and fast.is_plain_greedy == ref.is_plain_greedy
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(4))
        assert torch.equal(Sampler()(logits, fast).token_ids, Sampler()(logits, ref).token_ids)
        if not ref.all_greedy:
            for name in ("is_greedy", "temperature", "keys", "top_k", "top_p", "min_p"):
                assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert RowSpec.of(SamplingParams(logprobs=1), 0, V) is None
    assert RowSpec.of(SamplingParams(presence_penalty=0.5), 0, V) is None


def test_blocked_noise_and_fused_draw_match_the_one_shot_torch_forms():
    """The L2-blocked CPU forms (gumbel over the whole vocabulary, noisy_argmax) give the same
    bits as the one-shot torch expressions, across block edges and odd vocabulary sizes."""
    from deepinfer.engine.sample.sampler import noisy_argmax

    gen = torch.Generator().manual_seed(8)
    for num_rows, vocab in ((1, 3), (37, 1001), (70, 4096), (5, 70001)):
        keys = torch.randint(0, 2**32, (num_rows,), dtype=torch.int64, generator=gen)
        th = GumbelNoise().token_hash(vocab, keys.device)
        u = ((mix32_tensor(keys.unsqueeze(1) ^ th.unsqueeze(0)) >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        want = -torch.log(-torch.log(u))
        got = GumbelNoise().gumbel(keys, vocab)
        assert torch.equal(got, want), (num_rows, vocab)
        logits = torch.randn(num_rows, vocab, generator=gen) * 4
        logits[0, vocab // 2] = float("nan")  # NaN wins, as in torch's argmax
        temps = torch.rand(num_rows, generator=gen) + 0.1
        assert torch.equal(noisy_argmax(logits, temps, got), (logits / temps.unsqueeze(1) + want).argmax(dim=-1))


def test_noise_drawn_ahead_gives_the_same_tokens():
    """precompute_noise (caller's thread) changes where the noise is made, never a token: mixed
    greedy, plain, top-k, top-p and min-p rows, with and without it."""
    gen = torch.Generator().manual_seed(9)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=4),
             SamplingParams(temperature=0.9, top_p=0.7), SamplingParams(temperature=0.6, min_p=0.1)]
    for chosen in (kinds[1:2], kinds[:2], kinds[1:3], kinds, kinds[3:]):
        rows = [SampleRow(chosen[i % len(chosen)], seed=20 + i, position=5 + i) for i in range(23)]
        logits = torch.randn(len(rows), V, generator=gen) * 3
        plain, ahead = meta(rows), meta(rows)
        Sampler().precompute_noise(ahead, V)
        assert ahead.noise is not None
        assert torch.equal(Sampler()(logits, ahead).token_ids, Sampler()(logits, plain).token_ids)
        assert plain.is_all_sampled == (chosen[0].temperature > 0 and all(p.temperature > 0 for p in chosen))


def test_token_hash32_holds_the_same_bits_as_token_hash():
    noise = GumbelNoise()
    for vocab in (5, 4096, 129_280):
        th, th32 = noise.token_hash(vocab, torch.device("cpu")), noise.token_hash32(vocab, torch.device("cpu"))
        assert th32.dtype == torch.int32 and bool((th32 < 0).any()) == bool((th >= 1 << 31).any())
        assert torch.equal(th32.to(torch.int64) & 0xFFFFFFFF, th)
