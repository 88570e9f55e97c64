"""A step's sampling inputs: request state (seeds, positions, penalty history, grammar bitmasks)
to per-row values to batch tensors, on the caller's thread. The device thread's half, sampling
from the logits, is sampler.py; ``EngineCore.prepare_sampling`` / ``run_sampling`` call the two.

One row = one sampled position (a decode, a final prefill chunk, or one position of a
speculative run). Everything the sampler needs is a function of the row alone, which is what
makes sampling batch-invariant. ``SamplingPreparer.prepare`` reads request state and must run
after the previous step is committed.

Plain steps (the serving common case: every sampled sequence has one sample row, no drafts, no
prompt logprobs, no penalties, no logprobs, no grammar, past min_tokens) take a fast path: each
request's sampling constants are computed once (``RowSpec``, cached on the Request) and the
step's tensors are built from them and the positions alone; keys are hashed vectorised. The
general path builds one ``SampleRow`` per row. Both produce the same tensors for the same rows,
so which path a step takes never changes a token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.request import Request
from deepinfer.engine.sample.structured_output import GrammarState, StructuredOutputBackend
from deepinfer.engine.sched.types import SchedulerOutput
from deepinfer.kernels.counter_rng import row_key, row_keys, seed_key

if TYPE_CHECKING:
    from deepinfer.engine.sample.sampler import Sampler


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


@dataclass(slots=True)
class SamplingPrep:
    """What ``SamplingPreparer.prepare`` hands to ``Sampler.sample_step`` (built from request state)."""

    meta: SamplingMetadata | None = None
    row_index: torch.Tensor | None = None  # logit rows that are sampled (None: all, in order)
    request_rows: dict[str, range] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # empty on plain steps
    prompt_index: torch.Tensor | None = None  # logit rows scored for prompt logprobs
    prompt_targets: torch.Tensor | None = None
    prompt_rows: dict[str, range] = field(default_factory=dict)
    max_prompt_top: int = 0
    plain_ids: list[str] | None = None  # plain step: the request of each sample row, in order


class SamplingPreparer:
    def __init__(
        self,
        requests: Mapping[str, Request],
        grammars: Mapping[str, GrammarState],
        vocab_size: int,
        device: str,
        structured_output: StructuredOutputBackend | None,
        sampler: Sampler,
    ) -> None:
        """``requests`` and ``grammars`` are the live maps (read at each prepare); ``sampler``
        draws the rows' noise ahead (``Sampler.precompute_noise``)."""
        self.requests = requests
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.device = device
        self.structured_output = structured_output
        self.sampler = sampler

    def prepare(self, sched: SchedulerOutput) -> SamplingPrep:
        prep = self._prepare_plain(sched)
        return prep if prep is not None else self._prepare_general(sched)

    def _prepare_plain(self, sched: SchedulerOutput) -> SamplingPrep | None:
        """None when some sequence needs the general path."""
        requests, grammars = self.requests, self.grammars
        specs: list[RowSpec] = []
        positions: list[int] = []
        ids: list[str] = []
        for s in sched.scheduled:
            num_logits = s.step.num_logits
            if not num_logits:
                continue  # a middle prefill chunk
            if num_logits != 1 or s.num_sample_rows != 1:
                return None  # prompt logprobs or drafts
            rid = s.request_id
            req = requests.get(rid)
            if req is None:
                return None  # finished since it was scheduled: its row is skipped (general path)
            spec = req.row_spec
            if spec is None:
                spec = req.row_spec = RowSpec.of(req.sampling_params, req.seed, self.vocab_size) or False
            if spec is False or len(req.output_token_ids) < req.sampling_params.min_tokens or rid in grammars:
                return None
            specs.append(spec)
            positions.append(len(req.all_token_ids))
            ids.append(rid)
        prep = SamplingPrep(plain_ids=ids)
        if ids:
            prep.meta = SamplingMetadata.from_plain(specs, positions, self.device)
            self.sampler.precompute_noise(prep.meta, self.vocab_size)  # off the device thread
            prep.request_rows = {rid: range(i, i + 1) for i, rid in enumerate(ids)}
        return prep

    def _prepare_general(self, sched: SchedulerOutput) -> SamplingPrep:
        prep = SamplingPrep()
        requests = self.requests
        rows: list[SampleRow] = []
        row_index: list[int] = []
        grammar_rows: list[tuple[GrammarState, int, list[int]]] = []
        prompt_index: list[int] = []
        prompt_targets: list[int] = []
        offset = 0
        for s in sched.scheduled:
            req = requests.get(s.request_id)
            start, offset = offset, offset + s.step.num_logits
            if req is None:
                continue  # finished or aborted since it was scheduled
            if s.num_prompt_logprob_rows:
                first = s.first_prompt_logprob_row
                prep.prompt_rows[s.request_id] = range(len(prompt_index), len(prompt_index) + s.num_prompt_logprob_rows)
                prompt_index.extend(range(start, start + s.num_prompt_logprob_rows))
                prompt_targets.extend(req.all_token_ids[first + 1 : first + 1 + s.num_prompt_logprob_rows])
                prep.max_prompt_top = max(prep.max_prompt_top, req.sampling_params.prompt_logprobs)
            if not s.num_sample_rows:
                continue
            drafts = list(s.step.token_ids[len(s.step.token_ids) - s.num_draft_tokens :]) if s.num_draft_tokens else []
            params = req.sampling_params
            prep.request_rows[s.request_id] = range(len(rows), len(rows) + s.num_sample_rows)
            prep.drafts[s.request_id] = drafts
            grammar = self.grammars.get(s.request_id)
            if grammar is not None:
                grammar_rows.append((grammar, len(rows), drafts))
            num_tokens, num_out = req.num_tokens, req.num_output_tokens
            penalized = has_penalties(params)
            for k in range(s.num_sample_rows):
                suppress = ()
                if num_out + k < params.min_tokens:
                    suppress = tuple(req.eos_token_ids) + tuple(params.stop_token_ids)
                history = req.output_token_ids + drafts[:k] if penalized else ()
                rows.append(SampleRow(params, req.seed, num_tokens + k, req.prompt_token_ids, history, suppress))
                row_index.append(start + s.num_prompt_logprob_rows + k)
        device = self.device
        if rows:
            bitmask = None
            if grammar_rows:
                bitmask = self.structured_output.allocate_bitmask(len(rows))
                for grammar, first, drafts in grammar_rows:
                    grammar.fill_bitmasks_for_drafts(bitmask, first, drafts)
            prep.meta = SamplingMetadata.build(rows, self.vocab_size, device, bitmask)
            self.sampler.precompute_noise(prep.meta, self.vocab_size)
            if len(row_index) != offset or row_index[-1] != offset - 1:  # not simply every row
                prep.row_index = host_tensor(row_index, torch.int64, device)
        if prompt_index:
            prep.prompt_index = host_tensor(prompt_index, torch.int64, device)
            prep.prompt_targets = host_tensor(prompt_targets, torch.int64, device)
        return prep
