"""A step's sampling inputs from request state (caller's thread) and the sampling itself
(device thread): the two halves EngineCore.prepare_sampling / run_sampling delegate to.

``prepare`` reads request state (seeds, positions, penalty history, grammar bitmasks) and must
run after the previous step is committed; ``run`` touches only tensors and the prepared values,
so it is safe on the executor thread that runs the forwards.

Plain steps (the serving common case: every sampled sequence has one sample row, no drafts, no
prompt logprobs, no penalties, no logprobs, no grammar, past min_tokens) take a fast path: each
request's sampling constants are computed once (``RowSpec``, cached on the Request) and the
step's tensors are built from them and the positions alone; keys are hashed vectorised. The
general path builds one ``SampleRow`` per row. Both produce the same tensors for the same rows,
so which path a step takes never changes a token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from deepinfer.engine.core.request import Request
from deepinfer.engine.sample.metadata import RowSpec, SampleRow, SamplingMetadata, has_penalties, host_tensor
from deepinfer.engine.sample.sampler import LogprobsTensors, Sampler, SamplerOutput, gather_logprobs
from deepinfer.engine.sample.structured_output import GrammarState, StructuredOutputBackend
from deepinfer.engine.sched.types import SchedulerOutput


@dataclass(slots=True)
class SamplingPrep:
    """What ``prepare`` hands to ``run`` (built from request state)."""

    meta: SamplingMetadata | None = None
    row_index: torch.Tensor | None = None  # logit rows that are sampled (None: all, in order)
    request_rows: dict[str, range] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # empty on plain steps
    prompt_index: torch.Tensor | None = None  # logit rows scored for prompt logprobs
    prompt_targets: torch.Tensor | None = None
    prompt_rows: dict[str, range] = field(default_factory=dict)
    max_prompt_top: int = 0
    plain_ids: list[str] | None = None  # plain step: the request of each sample row, in order


@dataclass(slots=True)
class SampledStep:
    """One step's sampled tokens. The device thread stores only what the next step's forward
    needs; on a plain step (one row per request) that is the row tokens in order
    (``plain_tokens``, rows of ``plain_ids``), and the per-request maps ``last_tokens`` and
    ``accepted`` are built when first read, normally by the caller's thread while the next
    forward runs: the device thread's time between forwards cannot be hidden."""

    sampler_output: SamplerOutput | None = None
    request_rows: dict[str, range] = field(default_factory=dict)  # rows of sampler_output per request
    prompt_logprobs: LogprobsTensors | None = None
    prompt_rows: dict[str, range] = field(default_factory=dict)
    plain_ids: list[str] | None = None  # plain step: the request of each row (SamplingPrep.plain_ids)
    plain_tokens: list[int] | None = None  # plain step: the token sampled in each row
    _last_tokens: dict[str, int] | None = None  # None on a plain step until asked for
    _accepted: dict[str, list[int]] | None = None

    @property
    def last_tokens(self) -> dict[str, int]:
        """request id -> last accepted token (what a placeholder of the next step stands for)."""
        if self._last_tokens is None:
            self._last_tokens = dict(zip(self.plain_ids or (), self.plain_tokens or ()))
        return self._last_tokens

    @property
    def accepted(self) -> dict[str, list[int]]:
        """request id -> accepted tokens (1 + accepted drafts)."""
        if self._accepted is None:
            self._accepted = {rid: [tok] for rid, tok in zip(self.plain_ids or (), self.plain_tokens or ())}
        return self._accepted


class SamplingPreparer:
    def __init__(
        self,
        requests: Mapping[str, Request],
        grammars: Mapping[str, GrammarState],
        vocab_size: int,
        device: str,
        structured_output: StructuredOutputBackend | None,
    ) -> None:
        """``requests`` and ``grammars`` are the live maps (read at each prepare)."""
        self.requests = requests
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.device = device
        self.structured_output = structured_output
        self.sampler = Sampler()

    # ---- caller's thread ----------------------------------------------------------------
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

    # ---- device thread ------------------------------------------------------------------
    def run(self, prep: SamplingPrep, logits: torch.Tensor) -> SampledStep:
        """Tensor work only: sample, verify drafts, logprobs."""
        out = SampledStep(request_rows=prep.request_rows, prompt_rows=prep.prompt_rows)
        if prep.meta is not None:
            sel = logits if prep.row_index is None else logits.index_select(0, prep.row_index)
            out.sampler_output = self.sampler(sel, prep.meta)
            sampled = out.sampler_output.token_ids.tolist()
            if prep.plain_ids is not None:
                out.plain_ids, out.plain_tokens = prep.plain_ids, sampled  # maps built on demand
            else:
                out._accepted = {rid: verify_drafts(sampled[r.start : r.stop], prep.drafts[rid])
                                 for rid, r in prep.request_rows.items()}
                out._last_tokens = {rid: toks[-1] for rid, toks in out._accepted.items()}
        elif prep.plain_ids is not None:
            out.plain_ids, out.plain_tokens = prep.plain_ids, []
        if prep.prompt_index is not None:
            lp = logits.index_select(0, prep.prompt_index).float().log_softmax(dim=-1)
            out.prompt_logprobs = gather_logprobs(lp, prep.prompt_targets, prep.max_prompt_top)
        return out


def verify_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """Accept drafts while each equals the token the sampler draws at its position, then the
    first differing (or bonus) token. With counter-based sampling the result is exactly what
    non-speculative decoding produces: drafts change speed, never outputs."""
    accepted = []
    for k, tok in enumerate(sampled):
        accepted.append(tok)
        if k >= len(drafts) or tok != drafts[k]:
            break
    return accepted
