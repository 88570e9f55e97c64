"""Per-step sampling inputs as batch tensors, built once per step from plain per-row values.

One row = one sampled position (a decode, a final prefill chunk, or one position of a
speculative run). Everything the sampler needs is a function of the row alone, which is what
makes sampling batch-invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.kernels.counter_rng import row_key, row_keys, seed_key


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the caller's thread: on CUDA it is staged in
    pinned memory and copied asynchronously in stream order. (A copy from pageable memory can
    block the caller until the stream drains, i.e. until the forward in flight ends, holding the
    GIL the device thread then needs: sampled steps lost ~0.6 ms per step to it.)"""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_tensor(data, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` through ``to_device``."""
    return to_device(torch.tensor(data, dtype=dtype), device)


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    position: int  # absolute position of the token being sampled: the RNG counter
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # history for penalties (outputs + earlier drafts)
    suppress_token_ids: Sequence[int] = ()  # masked to -inf (EOS/stop ids before min_tokens)


@dataclass(slots=True)
class PenaltyTensors:
    output_counts: torch.Tensor  # [B, V] float32: occurrences in the output so far
    seen_mask: torch.Tensor  # [B, V] bool: in prompt or output (repetition penalty)
    repetition: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    presence: torch.Tensor  # [B, 1]


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    temperature: torch.Tensor  # [B] float32 (1.0 on greedy rows, unused there)
    keys: torch.Tensor  # [B] int64 counter-RNG keys of (seed, position)
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    penalties: PenaltyTensors | None
    suppress: tuple[torch.Tensor, torch.Tensor] | None  # (row idx, token idx)
    bitmask: torch.Tensor | None  # [B, ceil(V/32)] int32 allowed-token bits (structured output)
    num_logprobs: list[int | None]  # per row: None = no logprobs
    max_num_logprobs: int | None
    # every row greedy with no mask, penalty or logprobs: the sampler is one argmax
    is_plain_greedy: bool = False
    is_all_sampled: bool = False  # no greedy row: the sampler needs no row gather or scatter
    # Gumbel noise of the rows that draw over the whole vocabulary (sampled, no top-k), in row
    # order, computed ahead by ``Sampler.precompute_noise`` on the caller's thread; None: the
    # sampler draws it itself
    noise: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        rows: Sequence[SampleRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        b = len(rows)
        # one pass over the rows collects everything; tensors only for features in use
        greedy, temps, keys, nlp = [], [], [], []
        any_k = any_p = any_min_p = any_penalty = any_suppress = False
        for r in rows:
            p = r.params
            g = p.temperature == 0.0
            greedy.append(g)
            temps.append(1.0 if g else float(p.temperature))
            keys.append(row_key(r.seed, r.position))
            nlp.append(p.logprobs)
            if not g:
                any_k = any_k or p.top_k > 0
                any_p = any_p or p.top_p < 1.0
                any_min_p = any_min_p or p.min_p > 0.0
            any_penalty = any_penalty or has_penalties(p)
            any_suppress = any_suppress or bool(r.suppress_token_ids)
        params = [r.params for r in rows] if (any_k or any_p or any_min_p) else []

        top_k = top_p = min_p = None
        if any_k:
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64)
        if any_p:
            top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
        if any_min_p:
            min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32)

        penalties = _build_penalties(rows, vocab_size, device) if any_penalty else None

        suppress = None
        if any_suppress:
            ri = [i for i, r in enumerate(rows) for _ in r.suppress_token_ids]
            ti = [t for r in rows for t in r.suppress_token_ids]
            suppress = (host_tensor(ri, torch.int64, device), host_tensor(ti, torch.int64, device))

        wanted = [n for n in nlp if n is not None]
        all_greedy = all(greedy)
        return cls(
            num_rows=b,
            is_greedy=host_tensor(greedy, torch.bool, device),
            all_greedy=all_greedy,
            temperature=host_tensor(temps, torch.float32, device),
            keys=host_tensor(keys, torch.int64, device),
            top_k=to_device(top_k, device) if top_k is not None else None,
            top_p=to_device(top_p, device) if top_p is not None else None,
            min_p=to_device(min_p, device) if min_p is not None else None,
            penalties=penalties,
            suppress=suppress,
            bitmask=to_device(bitmask, device) if bitmask is not None else None,
            num_logprobs=nlp,
            max_num_logprobs=max(wanted) if wanted else None,
            is_plain_greedy=all_greedy and not wanted and penalties is None and suppress is None and bitmask is None,
            is_all_sampled=b > 0 and not any(greedy),
        )

    @classmethod
    def from_plain(
        cls, specs: Sequence[RowSpec], positions: Sequence[int], device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """``build`` for rows of plain requests (``RowSpec.of`` not None), one per spec, sampling
        at ``positions``: no per-row objects, keys hashed vectorised, same tensors as ``build``."""
        b = len(specs)
        none: list[int | None] = [None] * b
        if all(s.is_greedy for s in specs):
            return cls(
                num_rows=b, is_greedy=torch.ones(b, dtype=torch.bool, device=device), all_greedy=True,
                temperature=torch.ones(b, dtype=torch.float32, device=device),
                keys=torch.zeros(b, dtype=torch.int64, device=device),  # greedy rows draw no noise
                top_k=None, top_p=None, min_p=None, penalties=None, suppress=None, bitmask=None,
                num_logprobs=none, max_num_logprobs=None, is_plain_greedy=True,
            )  # fmt: skip
        keys = torch.from_numpy(row_keys([s.seed_key for s in specs], positions))
        sampled = [s for s in specs if not s.is_greedy]
        any_k = any(s.top_k > 0 for s in sampled)
        any_p = any(s.top_p < 1.0 for s in sampled)
        any_min_p = any(s.min_p > 0.0 for s in sampled)
        return cls(
            num_rows=b,
            is_greedy=host_tensor([s.is_greedy for s in specs], torch.bool, device),
            all_greedy=False,
            is_all_sampled=not any(s.is_greedy for s in specs),
            temperature=host_tensor([s.temperature for s in specs], torch.float32, device),
            keys=to_device(keys, device),
            top_k=host_tensor([s.top_k for s in specs], torch.int64, device) if any_k else None,
            top_p=host_tensor([s.top_p for s in specs], torch.float32, device) if any_p else None,
            min_p=host_tensor([s.min_p for s in specs], torch.float32, device) if any_min_p else None,
            penalties=None, suppress=None, bitmask=None, num_logprobs=none, max_num_logprobs=None,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What a *plain* request (no penalties, no logprobs) contributes to each of its sample rows,
    computed once per request instead of once per row and step. ``top_k`` is already resolved
    against the vocabulary (vocab_size where disabled)."""

    is_greedy: bool
    temperature: float  # 1.0 on greedy rows (unused there)
    top_k: int
    top_p: float
    min_p: float
    seed_key: int  # counter_rng.seed_key(seed)

    @classmethod
    def of(cls, params: SamplingParams, seed: int, vocab_size: int) -> RowSpec | None:
        """None when the request needs per-row state (penalty history, logprobs)."""
        if has_penalties(params) or params.logprobs is not None:
            return None
        g = params.temperature == 0.0
        return cls(g, 1.0 if g else float(params.temperature), params.top_k if params.top_k > 0 else vocab_size,
                   float(params.top_p), float(params.min_p), seed_key(seed))


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _build_penalties(rows: Sequence[SampleRow], vocab_size: int, device) -> PenaltyTensors:
    b = len(rows)
    out_rows, out_toks, seen_rows, seen_toks = [], [], [], []
    for i, r in enumerate(rows):
        if not has_penalties(r.params):
            continue
        out_rows += [i] * len(r.output_token_ids)
        out_toks += r.output_token_ids
        if r.params.repetition_penalty != 1.0:
            seen_rows += [i] * len(r.prompt_token_ids)
            seen_toks += r.prompt_token_ids
    counts = torch.zeros(b, vocab_size, dtype=torch.float32, device=device)
    if out_toks:
        idx = (host_tensor(out_rows, None, device), host_tensor(out_toks, None, device))
        counts.index_put_(idx, torch.ones(len(out_toks), device=device), accumulate=True)
    seen = counts > 0
    if seen_toks:
        seen[host_tensor(seen_rows, None, device), host_tensor(seen_toks, None, device)] = True

    def col(name: str) -> torch.Tensor:
        return host_tensor([float(getattr(r.params, name)) for r in rows], None, device).unsqueeze(1)

    return PenaltyTensors(counts, seen, col("repetition_penalty"), col("frequency_penalty"), col("presence_penalty"))
