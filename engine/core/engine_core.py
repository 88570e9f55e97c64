"""One replica's engine core: requests in, steps as calls, output deltas out.

``EngineCore`` owns the scheduler, the sampling preparer, the sampler and the output processor
of one replica and exposes a step as calls that the one step loop (step_loop.py) and the device
chain (device_chain.py) interleave: ``schedule_step`` -> ``prepare_sampling`` -> (device thread)
``execute`` -> ``run_sampling`` [-> ``fill_placeholders`` of the next step] -> ``commit_step``.
``fill_placeholders``, ``execute`` and ``run_sampling`` run in order on ONE worker thread (the
"device thread"); everything else runs on the loop's thread. Which call overlaps which, and why
that order is safe, is drawn once in ARCHITECTURE.md ("The step timeline").

The worker touches only the runner, the plans' batches and the prepared tensors; add_request /
abort run on the loop's thread between these calls. Results of a request that finished or was
aborted while a later step was in flight are dropped when that step commits; its blocks may be
handed out again only to steps that execute after the in-flight one (execution is serial).

Request facts are checked once, by their owner: the caller's request id and the vocabulary
here, the prompt's length and the scheduler's own table in ``Scheduler.add_request``, the
sampling parameters in ``SamplingParams``; bad input raises ``InvalidPromptError`` (one line).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from deepinfer.cache.block_pool import BlockEvent, BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.protocol import EngineOverloadedError, InvalidPromptError
from deepinfer.engine.api.sampling_params import SamplingParams, choice_params
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.hooks import EngineHooks
from deepinfer.engine.core.request import RequestStatus
from deepinfer.engine.mm.inputs import MultiModalInput
from deepinfer.engine.mm.placement import check_image_positions
from deepinfer.engine.sample.metadata import SamplingPrep, SamplingPreparer
from deepinfer.engine.sample.sampler import SampledStep, Sampler
from deepinfer.engine.sample.structured_output import GrammarState, StructuredOutputBackend
from deepinfer.engine.sched.cost_model import CostModel
from deepinfer.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput
from deepinfer.engine.spec.proposer import StepDrafts
from deepinfer.engine.text.output_processor import DetokenizerFactory, OutputProcessor, format_logprobs


class ModelRunner(Protocol):
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch.num_logits, vocab]``: for each SeqStep in order, its last
        ``num_logits`` positions. Must return once the logits are ready (synchronised)."""


@dataclass(frozen=True, slots=True)
class EngineCoreConfig:
    scheduler: SchedulerConfig
    num_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    device: str = "cpu"  # where the logits live / sampling runs
    max_num_waiting: int | None = None  # queue capacity: beyond it add_request raises EngineOverloadedError
    # the token every image-span position holds (a model with a vision tower, V4.1): a prompt
    # holds it exactly at its images' spans; None: the model takes no images
    image_token_id: int | None = None
    hidden_size: int | None = None  # the width of image embeddings (checked at arrival)


@dataclass(slots=True)
class StepPlan:
    sched: SchedulerOutput
    batch: ForwardBatch
    exec_seconds: float | None = None
    # KV tiers (engine/kv/offload.py): block copies out of / into the device that must run on
    # the device thread right before this plan's forward
    device_io: Callable[[], None] | None = None
    # DSpark: the drafts proposed after this plan's sampling (device thread), counted at commit
    drafts: StepDrafts | None = None
    # DSpark: whether the drafter runs after this plan's sampling (its gate may skip a step)
    drafter_runs: bool = True

    @property
    def is_empty(self) -> bool:
        return self.sched.is_empty


class PlaceholderRows(NamedTuple):
    """A plan's placeholders as (token list, index, row of the previous step's plain tokens)."""

    source: list[str]  # the previous step's SamplingPrep.plain_ids (identity-checked)
    targets: list[tuple[list[int], int, int]]


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineCoreConfig,
        *,
        detokenizer_factory: DetokenizerFactory | None = None,
        decode_token: Callable[[int], str] | None = None,
        structured_output: StructuredOutputBackend | None = None,
        cost_model: CostModel | None = None,
        seed_rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        step_timer: Callable[[], float] = time.perf_counter,
        hooks: EngineHooks = EngineHooks(),
    ) -> None:
        """``hooks``: the optional parts (SWA slots, KV tiers) this core is built with (hooks.py)."""
        self.runner = runner
        self.config = config
        sc = config.scheduler
        self.cost_model = cost_model
        self.hooks = hooks
        self.scheduler = Scheduler(sc, BlockPool(config.num_blocks, sc.block_size, enable_prefix_caching=sc.enable_prefix_caching),
                                   SlotPool(sc.max_num_seqs), cost_model, swa_slots=hooks.swa_slots,
                                   kv_offload=hooks.kv_offload)
        self.outputs = OutputProcessor(detokenizer_factory, decode_token)
        self.structured_output = structured_output
        self._grammars: dict[str, GrammarState] = {}
        self.sampler = Sampler()
        self._sampling = SamplingPreparer(self.scheduler.requests, self._grammars, config.vocab_size, config.device,
                                          structured_output, self.sampler)
        self._children: dict[str, list[str]] = {}  # parent id -> engine request ids
        self._parent_of: dict[str, str] = {}
        self._seed_rng = seed_rng or random.SystemRandom()
        self._clock = clock  # timestamps in outputs (arrival, first token, finish)
        self._step_timer = step_timer  # forward durations for the cost model
        self.num_steps = 0
        # KV tiers: host tier / store behind the device pool (used by kv/manager.py, the
        # scheduler's admission, schedule_step, execute and commit_step's metrics)
        self.kv_offload = hooks.kv_offload
        # DSpark (engine/spec/decoding.py): verify lengths before scheduling, drafts after
        # sampling, counters at commit; None: no speculation
        self.spec = hooks.spec

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
        cache_salt: str = "",
        grammar=None,
    ) -> None:
        """Queue a request (``n`` completions become ``n`` engine requests sharing the prompt).
        Raises ``InvalidPromptError`` (one line) for bad input, ``EngineOverloadedError`` when the
        waiting queue is full, and changes nothing then.
        ``mm_inputs``: the prompt's images, their spans of image-token positions and embeddings
        (engine/mm/placement.py says what must hold).
        ``grammar``: ``params.structured_outputs`` already compiled (``compile_grammar``, off the
        loop's thread: a big schema never stalls it); compiled here when not given."""
        if request_id in self._children:
            raise InvalidPromptError(f"request id {request_id!r} is already in use")
        cap = self.config.max_num_waiting
        if cap is not None and len(self.scheduler.waiting) >= cap:
            raise EngineOverloadedError(f"the waiting queue is full ({cap} requests); retry shortly")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidPromptError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        image = self.config.image_token_id
        if mm_inputs or (image is not None and image in prompt_token_ids):  # a text prompt passes as is
            check_image_positions(prompt_token_ids, image, mm_inputs, self.config.hidden_size)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params.structured_outputs)
        arrival = self._clock() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        children = [params] if params.n == 1 else [choice_params(params, i) for i in range(params.n)]
        added: list[str] = []
        try:  # the scheduler checks the prompt's length and its own table first: nothing else changes then
            for cid, child_params in zip(child_ids, children):
                seed = child_params.seed if child_params.seed is not None else self._seed_rng.getrandbits(63)
                self.scheduler.add_request(cid, prompt_token_ids, child_params, seed=seed, arrival_time=arrival,
                                           eos_token_ids=self.config.eos_token_ids, mm_inputs=mm_inputs,
                                           cache_salt=cache_salt)
                added.append(cid)
            for i, (cid, child_params) in enumerate(zip(child_ids, children)):
                self.outputs.add_request(cid, request_id, i, params.n, prompt, prompt_token_ids, child_params, arrival)
        except (SchedulerError, ValueError):
            self.scheduler.abort(added)
            for cid in added:
                self.outputs.forget(cid)
            raise
        for cid in child_ids:
            if grammar is not None:
                self._grammars[cid] = self.structured_output.new_state(grammar)
            self._parent_of[cid] = request_id
        self._children[request_id] = child_ids

    def compile_grammar(self, spec):
        """``spec`` (``SamplingParams.structured_outputs``) compiled, for ``add_request(grammar=...)``;
        thread-safe and cached, so callers run it on a worker thread."""
        if self.structured_output is None:
            raise InvalidPromptError("structured_outputs need the tokenizer's vocabulary; this engine was started "
                                     "without a tokenizer")
        return self.structured_output.compile(spec)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests (by the id given to add_request); frees their blocks and slots."""
        outs = []
        now = self._clock()
        for rid in request_ids:
            for cid in self._children.pop(rid, ()):
                self.scheduler.abort([cid])
                self._grammars.pop(cid, None)
                self._parent_of.pop(cid, None)
                out = self.outputs.abort(cid, now)
                if out is not None:
                    outs.append(out)
        return outs

    # ---- hook (pd-disagg, engine/kv/handoff.py): tokens another engine generated ---------------
    def prime_outputs(self, request_id: str, token_ids: Sequence[int], logprobs: list | None = None,
                      *, emit: bool) -> RequestOutput | None:
        """Append ``token_ids`` as already-sampled outputs of ``request_id`` (added with n == 1,
        not yet scheduled): the sequence, the grammar and the detokenizer advance exactly as if
        this engine had sampled them, so sampling positions, penalty counts and text continue
        unchanged. Returns their delta when ``emit`` (the client has not seen them yet); None
        when they were already streamed (a request resumed after losing its engine)."""
        req = self.scheduler.requests[request_id]
        assert req.num_computed_tokens == 0 and req.num_output_placeholders == 0, "prime before scheduling"
        req.append_output_tokens(token_ids, self.config.scheduler.block_size)
        grammar = self._grammars.get(request_id)
        if grammar is not None and grammar.accept(token_ids) < len(token_ids):
            raise ValueError(f"request {request_id!r}: the grammar rejects the handed-over tokens")
        processed = self.outputs.process(request_id, token_ids, logprobs, None, None, self._clock())
        if processed.stop_string is not None:  # the sender would have finished it: keep both in step
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED, processed.stop_string)
            self._grammars.pop(request_id, None)
            self._forget_child(request_id)
        return processed.output if emit else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def parent_id(self, engine_request_id: str) -> str:
        """The id given to add_request for one of its engine requests (``id#i`` when n > 1)."""
        return self._parent_of.get(engine_request_id, engine_request_id)

    def drain_kv_events(self) -> list[BlockEvent]:
        return self.scheduler.pool.drain_events()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = set(self.scheduler.requests)
        assert set(self._grammars) <= live, "grammar state of a finished request"
        assert all(self.outputs.has_request(r) for r in live), "a live request has no output state"

    # ---- the step, as calls (step_loop.py drives them) -------------------------------------
    def schedule_step(self) -> StepPlan:
        drafter_runs = True
        if self.spec is not None:
            drafter_runs = self.spec.plan_lengths(self.scheduler.requests, self.scheduler.running)
        sched = self.scheduler.schedule()
        plan = StepPlan(sched, sched.batch, drafter_runs=drafter_runs)
        if self.kv_offload is not None and not sched.is_empty:
            plan.device_io = self.kv_offload.take_device_io()
        return plan

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """The device part (thread-safe w.r.t. the other calls): runs and times the forward."""
        if plan.device_io is not None:  # KV tier copies, before the forward reads the blocks
            plan.device_io()
        t0 = self._step_timer()
        logits = self.runner.execute(plan.batch)
        plan.exec_seconds = self._step_timer() - t0
        if logits.shape[0] != plan.sched.num_logits:  # (counted while scheduling: no pass over the batch here)
            raise RuntimeError(f"runner returned {logits.shape[0]} logit rows for {plan.sched.num_logits} requested")
        return logits

    def fill_placeholders(self, plan: StepPlan, prev: SampledStep, rows: PlaceholderRows | None = None) -> None:
        """Write the tokens ``prev`` sampled into ``plan``'s placeholder positions; ``rows``
        (from ``placeholder_rows``, caller's thread) makes it one flat loop on a plain step."""
        if rows is not None and rows.source is prev.plain_ids:
            tokens = prev.plain_tokens
            for ids, pos, row in rows.targets:
                ids[pos] = tokens[row]
            return
        last_tokens = prev.last_tokens
        for rid, ids, pos in plan.sched.placeholders:  # listed by the scheduler
            # A request that vanished in between gets any valid id: its result is dropped.
            ids[pos] = last_tokens.get(rid, 0)

    @staticmethod
    def placeholder_rows(plan: StepPlan, prev: SamplingPrep) -> PlaceholderRows | None:
        """Resolve ``plan``'s placeholders to rows of the step ``prev`` prepared (one step
        ahead, on the caller's thread while that step's forward runs). None unless ``prev`` is
        plain (one row per request; with drafts the row of the last accepted token is known only
        after sampling) and lists every placeholder's request."""
        ids = prev.plain_ids
        placeholders = plan.sched.placeholders
        if ids is None or not placeholders:
            return None
        rid2row = {rid: row for row, rid in enumerate(ids)}
        targets = []
        for rid, token_ids, pos in placeholders:
            row = rid2row.get(rid)
            if row is None:
                return None
            targets.append((token_ids, pos, row))
        return PlaceholderRows(ids, targets)

    def sample_step(self, plan: StepPlan, logits: torch.Tensor) -> SampledStep:
        return self.run_sampling(self.prepare_sampling(plan), logits, plan)

    def prepare_sampling(self, plan: StepPlan) -> SamplingPrep:
        """Per-row sampling inputs from request state (seeds, positions, penalty history, grammar
        bitmasks). Must run after the previous step is committed; touches no logits."""
        return self._sampling.prepare(plan.sched)

    def run_sampling(self, prep: SamplingPrep, logits: torch.Tensor, plan: StepPlan | None = None) -> SampledStep:
        """Tensor work only (safe in the device thread): sample, verify drafts, logprobs; with
        DSpark and ``plan``, then the drafter's pass over the forward's features (``plan.drafts``)."""
        sampled = self.sampler.sample_step(prep, logits)
        if self.spec is not None and plan is not None:
            plan.drafts = self.spec.propose(plan, sampled.accepted)
        return sampled

    def commit_step(self, plan: StepPlan, sampled: SampledStep) -> list[RequestOutput]:
        self.num_steps += 1
        if self.cost_model is not None and plan.exec_seconds is not None:
            self.cost_model.observe(plan.sched.features, plan.exec_seconds)
        now = self._clock()
        outputs: list[RequestOutput] = []
        finished: list = []  # (engine request id, metrics) of requests this step finished (DSpark counts)
        grammars, prompt_rows, process_one = self._grammars, sampled.prompt_rows, self.outputs.process_one
        pop_tiers = self.scheduler.kv.pop_cached_tokens_by_tier
        for upd in self.scheduler.update_from_output(plan.sched, sampled.accepted):
            req, rid = upd.request, upd.request.request_id
            tokens, params = upd.new_token_ids, req.sampling_params
            if (upd.finish_status is None and len(tokens) == 1 and not params.stop and params.logprobs is None
                    and rid not in grammars and rid not in prompt_rows):
                # one token that ends nothing and needs no text check: the per-step common case
                out = process_one(rid, tokens[0], now, max(req.num_cached_tokens, 0))
                if not out.metrics.cached_tokens_by_tier:  # once per request (kv_manager.py), as below
                    out.metrics.cached_tokens_by_tier = pop_tiers(rid) or {}
                outputs.append(out)
                continue
            if rid in sampled.prompt_rows:
                self.outputs.add_prompt_logprobs(rid, sampled.prompt_logprobs, sampled.prompt_rows[rid],
                                                 req.sampling_params.prompt_logprobs)
            tokens = upd.new_token_ids
            finish = upd.finish_status
            grammar = self._grammars.get(rid)
            if grammar is not None and tokens:
                if grammar.accept(tokens) < len(tokens):
                    # Only possible when no token was allowed (e.g. min_tokens masks the EOS the
                    # grammar requires): end this request, never the engine.
                    finish = RequestStatus.FINISHED_ABORTED
                elif grammar.is_terminated and finish is None:
                    finish = RequestStatus.FINISHED_STOPPED
            new_lp = None
            if req.sampling_params.logprobs is not None and tokens and sampled.sampler_output is not None:
                r = sampled.request_rows[rid]
                new_lp = format_logprobs(sampled.sampler_output.logprobs, range(r.start, r.start + len(tokens)),
                                         req.sampling_params.logprobs, self.outputs.decode_token)
            processed = self.outputs.process(
                rid, tokens, new_lp, finish.finish_reason if finish is not None else None,
                req.stop_reason if upd.finish_status is not None else None, now, max(req.num_cached_tokens, 0),
            )
            if processed.stop_string is not None:
                finish = RequestStatus.FINISHED_STOPPED
                self.scheduler.finish_requests([rid], finish, processed.stop_string)
            elif finish is not None and finish != upd.finish_status:
                self.scheduler.finish_requests([rid], finish)
            if finish is not None:
                self._grammars.pop(rid, None)
                self._forget_child(rid)
            if processed.output is not None:
                m = processed.output.metrics
                if m is not None and not m.cached_tokens_by_tier:  # once per request (kv_manager.py)
                    m.cached_tokens_by_tier = self.scheduler.kv.pop_cached_tokens_by_tier(rid) or {}
                outputs.append(processed.output)
                if finish is not None and m is not None and self.spec is not None:
                    finished.append((rid, m))
        if self.spec is not None:
            self.spec.commit(plan, sampled.accepted, plan.drafts, self.scheduler.requests)
            for rid, m in finished:  # this step's verification counted
                m.spec_counts = self.spec.request_counts(rid)
        return outputs

    def _forget_child(self, engine_request_id: str) -> None:
        parent = self._parent_of.pop(engine_request_id, None)
        kids = self._children.get(parent)
        if kids is not None and not any(k in self._parent_of for k in kids):
            del self._children[parent]

