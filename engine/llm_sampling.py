"""Sampling and logprobs for the offline loop (engine/llm.py): one sequence, one logits row.

Simple on purpose (the engine's batched sampler lives in engine/sampler.py): vLLM's meanings
for temperature, top_k, top_p, min_p, penalties and min_tokens; a per-sequence
``torch.Generator`` makes seeded sampling reproducible whatever else is in the batch.
Logprobs are taken from the model's raw logits (before penalties and temperature), as vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from deepinfer.engine.outputs import Logprob
from deepinfer.engine.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int],
    banned_ids: Sequence[int],
) -> torch.Tensor:
    """Penalties and bans applied to a float32 copy of one logits row."""
    x = logits.float().clone()
    if banned_ids:
        x[list(banned_ids)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if len(seen):
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long)
        freq = torch.tensor([counts[i] for i in counts], dtype=torch.float32)
        x[ids] -= params.frequency_penalty * freq + params.presence_penalty
    return x


def sample(x: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from processed logits ``x`` (greedy when temperature is 0)."""
    if params.is_greedy:
        return int(torch.argmax(x))
    x = x / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly more likely tokens
        drop = order[before >= params.top_p]
        probs[drop] = 0.0
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprob_entry(
    logprobs: torch.Tensor, token: int, num_top: int, decode=None
) -> dict[int, Logprob]:
    """``{token: Logprob}`` for ``token`` plus the ``num_top`` most likely tokens (rank 1 = best)."""

    def entry(t: int, value: float) -> Logprob:
        rank = int((logprobs > value).sum()) + 1
        return Logprob(logprob=value, rank=rank, decoded_token=None if decode is None else decode(t))

    result = {token: entry(token, float(logprobs[token]))}
    if num_top:
        top = torch.topk(logprobs, num_top)
        for value, t in zip(top.values.tolist(), top.indices.tolist()):
            if t not in result:
                result[t] = entry(t, value)
    return result
