"""Continuous-batching scheduler: a pure state machine with two verbs.

``schedule()`` decides what every request computes in the next forward; ``update_from_output()``
commits what the forward produced. There are no prefill/decode phases: each request's
``num_computed_tokens`` catches up with its known tokens, in chunks sized by the token budget and
the cost model, and one step mixes decodes, prefill chunks, replays and speculative runs.

Order inside one ``schedule()``:
  1. priority preemption: a waiting request with a strictly better priority than the worst
     running one takes its slot/blocks when those are short;
  2. running requests, decodes first (cheap, latency-bound), then prefill chunks, each in
     (priority, arrival) order; when blocks run out the worst not-yet-scheduled running request
     is preempted (recompute: blocks + slot freed, back to waiting, generated tokens kept);
  3. waiting requests in (priority, arrival) order (head-of-line: a request that does not fit
     stops admission, so later arrivals never overtake it), each looked up in the prefix cache.

Async scheduling (one step in flight): ``schedule()`` advances ``num_computed_tokens`` at once, so
it can run again before the previous step's tokens are known. A request whose in-flight step
samples a token gets a *placeholder* position in the next step: its SeqStep carries
``PLACEHOLDER_TOKEN_ID`` there, and the engine writes the sampled id into ``token_ids`` after
sampling the previous step and before launching this one (see engine_core.py). A block table list
handed to a SeqStep never changes afterwards: growing copies it first (the runner may be reading it
on the device thread), rollback and preemption replace it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.cache.block_hash import MultiModalSpan, extend_block_hashes, root_hash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.batch import SeqStep
from deepinfer.engine.cost_model import CostModel, StepFeatures
from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.request import Request, RequestStatus, check_token_stop
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sched_queue import WaitingQueue
from deepinfer.engine.sched_types import (
    PLACEHOLDER_TOKEN_ID,
    RequestUpdate,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
)

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RequestUpdate",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerOutput",
]

class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_pool: BlockPool,
        slot_pool: SlotPool,
        cost_model: CostModel | None = None,
    ) -> None:
        if block_pool.block_size != config.block_size:
            raise SchedulerError(f"block pool block_size {block_pool.block_size} != config {config.block_size}")
        self.config = config
        self.kv = KVManager(block_pool, slot_pool)
        self.pool = block_pool
        self.slots = slot_pool
        self.cost_model = cost_model
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._num_arrivals = 0
        self._next_seq_id = 0
        # [swa-slots hook] engine/swa_slots.py SwaSlotManager: restore a stored SWA slot at the
        # prefix-hit boundary instead of replaying (None: always replay)
        self.swa_slots = None
        self.num_preemptions = 0
        self._num_schedules = 0

    # ---- requests in / out ------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        seed: int,
        arrival_time: float = 0.0,
        eos_token_ids: Iterable[int] = (),
        mm_spans: Sequence[MultiModalSpan] = (),
        cache_salt: str = "",
    ) -> Request:
        if request_id in self.requests:
            raise SchedulerError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise SchedulerError(f"request {request_id!r}: the prompt is empty")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise SchedulerError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens leaves no room under "
                f"max_model_len {self.config.max_model_len}"
            )
        cfg = self.config
        req = Request(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            seed=seed,
            arrival_index=self._num_arrivals,
            arrival_time=arrival_time,
            eos_token_ids=frozenset(eos_token_ids),
            max_model_len=cfg.max_model_len,
            mm_spans=tuple(mm_spans),
            block_root=root_hash(cfg.model_id, cache_salt) if cfg.enable_prefix_caching else b"",
        )
        if req.block_root:
            extend_block_hashes(req.block_hashes, req.all_token_ids, cfg.block_size, req.block_root, req.mm_spans)
        self._next_seq_id += 1
        self._num_arrivals += 1
        self.requests[request_id] = req
        self.waiting.push(req)
        return req

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests as aborted, freeing everything they hold; unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, stop_reason: int | str | None = None
    ) -> list[Request]:
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status, stop_reason)
                done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self._num_schedules += 1
        ctx = _StepContext(budget=cfg.max_num_batched_tokens, features=out.features, step_no=self._num_schedules)
        if self.cost_model is not None and self.cost_model.is_fitted and cfg.step_time_target_s:
            ctx.time_target = cfg.step_time_target_s

        self._preempt_for_priority(out, ctx)
        num_block_preemptions = len(out.preempted_ids)

        # self.running is kept in (priority, arrival) order: decodes first, then chunks
        decodes, chunks = [], []
        for req in self.running:
            (decodes if len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens <= 1
             else chunks).append(req)
        if self._schedule_decodes(decodes, out, ctx):
            for req in chunks:
                if ctx.budget <= 0:
                    break
                self._schedule_running(req, out, ctx)

        if len(out.preempted_ids) == num_block_preemptions:
            self._admit_waiting(out, ctx)
        if self.cost_model is not None and self.cost_model.is_fitted:
            out.predicted_time_s = self.cost_model.predict(out.features)
        return out

    def _schedule_decodes(self, decodes: list[Request], out: SchedulerOutput, ctx: _StepContext) -> bool:
        """Schedule running requests with at most one token to compute; False when the budget
        ran out. A plain decode (one known-or-placeholder token, no drafts, blocks already in
        place, not at a length limit) is emitted inline, the rest go through
        ``_schedule_running``: at batch 256 this loop is most of ``schedule()``."""
        bs = self.config.block_size
        step_no = ctx.step_no
        scheduled, placeholders = out.scheduled, out.placeholders
        f = out.features
        running = RequestStatus.RUNNING
        for req in decodes:
            if ctx.budget <= 0:
                return False
            start = req.num_computed_tokens
            all_ids = req.all_token_ids
            num_known = len(all_ids)
            num_placeholders = req.num_output_placeholders
            max_tokens = req.sampling_params.max_tokens
            if (
                num_known + num_placeholders - start != 1
                or req.status != running
                or req.is_awaiting_verification
                or req.spec_token_ids
                or start >= len(req.block_ids) * bs
                or (max_tokens is not None and len(req.output_token_ids) + num_placeholders >= max_tokens)
                or num_known + num_placeholders >= req.max_model_len
            ):
                self._schedule_running(req, out, ctx)
                continue
            has_placeholder = start == num_known
            if has_placeholder:
                token_ids = [PLACEHOLDER_TOKEN_ID]
                placeholders.append((req.request_id, token_ids, 0))
            else:
                token_ids = [all_ids[start]]
            step = SeqStep(req.seq_id, req.slot, req.block_ids, start, token_ids, 1, req.window_start, req.write_from)
            scheduled.append(ScheduledSeq(req.request_id, step, 0, 0, 1, start, 0, has_placeholder, req.num_preemptions))
            req.num_computed_tokens = start + 1
            req.num_output_placeholders = num_placeholders + 1
            req.scheduled_in = step_no
            ctx.budget -= 1
            out.num_logits += 1
            f.num_seqs += 1
            f.sum_n += 1
            f.sum_np += start
            f.sum_n2 += 1
        return ctx.budget > 0

    def _schedule_running(self, req: Request, out: SchedulerOutput, ctx: _StepContext) -> None:
        """One running request's share of the step (any kind: decode, chunk, drafts)."""
        cfg = self.config
        if req.status != RequestStatus.RUNNING or req.is_awaiting_verification:
            return
        num_new = req.num_tokens_with_placeholders - req.num_computed_tokens
        if num_new <= 0 or req.has_reached_length_limit:
            return
        if num_new == 1 and not req.spec_token_ids and (req.num_computed_tokens + 1) <= len(req.block_ids) * cfg.block_size:
            self._emit_decode(req, out, ctx)
            return
        drafts: list[int] = []
        if num_new == 1 and req.num_output_placeholders == 0 and req.spec_token_ids:
            drafts = req.spec_token_ids[: cfg.max_num_spec_tokens]
        n = self._chunk_size(ctx, req.num_computed_tokens, num_new + len(drafts))
        if self.swa_slots is not None and n > 1 and not drafts:  # [swa-slots hook] end where a slot can be saved
            n = self.swa_slots.chunk_tokens(req, req.num_computed_tokens, n)
        if n <= 0:
            return
        end = req.num_computed_tokens + n
        if _cdiv(end, cfg.block_size) > len(req.block_ids):
            # Copy on grow: the step in flight holds the current list as its block table and
            # the runner reads it on the device thread while this one appends.
            req.block_ids = list(req.block_ids)
        while not self.kv.ensure_blocks(req, end):
            victim = max((r for r in self.running if r.scheduled_in != ctx.step_no), key=_sort_key)
            self._preempt(victim, out, ctx)
            if victim is req:
                break
        if req.status == RequestStatus.RUNNING:
            self._emit(req, n, drafts[: max(0, n - num_new)], out, ctx)

    def _admit_waiting(self, out: SchedulerOutput, ctx: _StepContext) -> None:
        cfg = self.config
        held_back: list[Request] = []
        while ctx.budget > 0 and len(self.waiting) > 0:
            req = self.waiting.peek()
            if req.num_output_placeholders > 0 or req.request_id in ctx.preempted_ids:
                # Preempted with a sampled token still in flight (its id is unknown) or in this
                # very step: it waits one step.
                held_back.append(self.waiting.pop())
                continue
            if not self.kv.is_kv_ready(req):
                # KV tiers (engine/kv_offload.py): its prefix blocks are still being read from
                # the store; it waits without holding the queue (a wait for KV, not a stall).
                held_back.append(self.waiting.pop())
                continue
            if len(self.running) >= cfg.max_num_seqs or self.slots.num_free_slots == 0:
                break
            hits = self.kv.lookup_prefix(req)
            hit_len = len(hits) * cfg.block_size
            is_restored = self.swa_slots is not None and self.swa_slots.has_slot(req, hit_len)  # [swa-slots hook]
            if is_restored:
                num_replay = 0
            else:
                num_replay = hit_len if cfg.max_replay_tokens is None else min(hit_len, cfg.max_replay_tokens)
            start = hit_len - num_replay
            n = self._chunk_size(ctx, start, req.num_tokens - start)
            if self.swa_slots is not None and n > 1:  # [swa-slots hook] end where a slot can be saved
                n = self.swa_slots.chunk_tokens(req, start, n, hit_len=hit_len)
            if n <= 0:
                break
            if not self.kv.admit(req, hits, start + n):
                break
            self.waiting.pop()
            req.num_computed_tokens = start
            req.window_start = 0 if is_restored else start  # a restored slot holds the whole window
            req.write_from = hit_len
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit_len
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_sort_key)
            if self.swa_slots is not None:  # [swa-slots hook] queue the restore / note an approximate replay
                self.swa_slots.on_admit(req, hit_len, is_restored=is_restored)
            self._emit(req, n, [], out, ctx)
        for req in held_back:
            self.waiting.push(req)

    def _preempt_for_priority(self, out: SchedulerOutput, ctx: _StepContext) -> None:
        """Let a strictly higher-priority waiting request displace the worst running ones."""
        head = self.waiting.peek()
        if head is None or head.num_output_placeholders > 0:
            return
        cfg = self.config
        first_chunk = min(head.num_tokens, cfg.max_num_batched_tokens)
        blocks_needed = _cdiv(first_chunk, cfg.block_size)
        while self.running:
            short_of_slot = len(self.running) >= cfg.max_num_seqs or self.slots.num_free_slots == 0
            short_of_blocks = self.pool.num_free_blocks < blocks_needed
            if not (short_of_slot or short_of_blocks):
                return
            victim = max(self.running, key=lambda r: r.sort_key)
            if victim.priority <= head.priority:
                return
            self._preempt(victim, out, ctx)

    def _chunk_size(self, ctx: _StepContext, prefix: int, wanted: int) -> int:
        n = min(wanted, ctx.budget)
        if ctx.time_target is not None and n > 1:
            fit = self.cost_model.max_chunk(ctx.features, prefix, ctx.time_target, n)
            floor = min(n, self.config.min_chunk_tokens) if ctx.num_chunks == 0 else 0
            n = max(fit, floor)
        return n

    def _emit_decode(self, req: Request, out: SchedulerOutput, ctx: _StepContext) -> None:
        """``_emit`` for one known-or-placeholder token, no drafts, blocks already in place."""
        start = req.num_computed_tokens
        has_placeholder = start == len(req.all_token_ids)
        token_ids = [PLACEHOLDER_TOKEN_ID] if has_placeholder else [req.all_token_ids[start]]
        if has_placeholder:
            out.placeholders.append((req.request_id, token_ids, 0))
        step = SeqStep(req.seq_id, req.slot, req.block_ids, start, token_ids, 1, req.window_start, req.write_from)
        out.scheduled.append(ScheduledSeq(req.request_id, step, 0, 0, 1, start, 0, has_placeholder, req.num_preemptions))
        out.num_logits += 1
        req.num_computed_tokens = start + 1
        req.num_output_placeholders += 1
        req.scheduled_in = ctx.step_no
        ctx.budget -= 1
        f = out.features
        f.num_seqs += 1
        f.sum_n += 1
        f.sum_np += start
        f.sum_n2 += 1

    def _emit(self, req: Request, n: int, drafts: list[int], out: SchedulerOutput, ctx: _StepContext) -> None:
        """Append req's SeqStep for positions [start, start + n) and advance its state."""
        start = req.num_computed_tokens
        n_known = n - len(drafts)
        known_end = min(start + n_known, req.num_tokens)
        num_placeholders = start + n_known - known_end
        assert num_placeholders <= req.num_output_placeholders, "placeholder beyond the tokens in flight"
        token_ids = req.all_token_ids[start:known_end]
        if num_placeholders:
            out.placeholders.append((req.request_id, token_ids, len(token_ids)))  # the first one
            token_ids += [PLACEHOLDER_TOKEN_ID] * num_placeholders
        token_ids += drafts
        reaches_end = start + n_known == req.num_tokens_with_placeholders
        num_sample_rows = 1 + len(drafts) if reaches_end else 0
        first_row, num_prompt_rows = start, 0
        if req.sampling_params.prompt_logprobs is not None:
            first_row = max(start, req.num_prompt_logprob_rows_done)
            num_prompt_rows = max(0, min(start + n_known, req.num_prompt_tokens - 1) - first_row)
        step = SeqStep(
            seq_id=req.seq_id,
            slot=req.slot,
            block_table=req.block_ids,
            start_pos=start,
            token_ids=token_ids,
            num_logits=num_prompt_rows + num_sample_rows,
            window_start=req.window_start,
            write_from=req.write_from,
        )
        out.scheduled.append(
            ScheduledSeq(
                request_id=req.request_id,
                step=step,
                num_replay_tokens=max(0, min(start + n, req.write_from) - start),
                num_draft_tokens=len(drafts),
                num_sample_rows=num_sample_rows,
                first_prompt_logprob_row=first_row,
                num_prompt_logprob_rows=num_prompt_rows,
                has_placeholder=num_placeholders > 0,
                preemption_epoch=req.num_preemptions,
            )
        )
        out.num_logits += step.num_logits
        req.num_computed_tokens = start + n
        if num_sample_rows:
            req.num_output_placeholders += 1
        if drafts:
            req.is_awaiting_verification = True
        req.spec_token_ids = []
        ctx.budget -= n
        req.scheduled_in = ctx.step_no
        out.features.add(n, start)
        if n > 1:
            ctx.num_chunks += 1

    # ---- commit -----------------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        """Commit a finished step. ``sampled[request_id]`` holds the accepted tokens of every
        request with sample rows: 1 + the number of accepted drafts (fewer than scheduled rolls
        ``num_computed_tokens`` back and frees blocks past the need). Requests finished or
        aborted since ``schedule()`` are skipped; a request preempted since then (stale epoch)
        keeps the tokens it sampled (they were computed from valid state) and nothing else."""
        bs = self.config.block_size
        updates: list[RequestUpdate] = []
        requests = self.requests
        for s in output.scheduled:
            req = requests.get(s.request_id)
            if req is None:
                continue
            is_stale = req.num_preemptions != s.preemption_epoch
            if s.num_sample_rows == 1 and not s.num_prompt_logprob_rows and not is_stale:
                tokens = sampled.get(s.request_id)
                if tokens is not None and len(tokens) == 1 and self._commit_one_token(req, s, tokens[0]):
                    updates.append(RequestUpdate(req, [tokens[0]], 0, None))
                    continue
            tokens = sampled.get(s.request_id, ())
            if s.num_prompt_logprob_rows:
                end_row = s.first_prompt_logprob_row + s.num_prompt_logprob_rows
                req.num_prompt_logprob_rows_done = max(req.num_prompt_logprob_rows_done, end_row)
            num_rejected = 0
            if s.num_sample_rows:
                if not 1 <= len(tokens) <= s.num_sample_rows:
                    raise ValueError(
                        f"request {s.request_id!r}: {len(tokens)} accepted tokens for {s.num_sample_rows} sample rows"
                    )
                req.num_output_placeholders -= 1
                req.is_awaiting_verification = False
                num_rejected = s.num_sample_rows - len(tokens)
            elif tokens:
                raise ValueError(f"request {s.request_id!r}: tokens given for a step that samples nothing")
            if num_rejected and not is_stale:
                req.num_computed_tokens -= num_rejected
            stop = check_token_stop(req, tokens)
            kept = list(tokens[: stop.num_kept])
            if kept:
                req.append_output_tokens(kept, bs)
            if not is_stale and req.status == RequestStatus.RUNNING:
                self.kv.register_blocks(req, s.step.end_pos - num_rejected)
                if num_rejected:
                    self.kv.trim_blocks(req)
            if stop.status is not None:
                self._finish(req, stop.status, stop.stop_reason)
            updates.append(RequestUpdate(req, kept, num_rejected, stop.status))
        return updates

    def _commit_one_token(self, req: Request, s: ScheduledSeq, tok: int) -> bool:
        """Fast path of update_from_output for one sampled token that stops nothing; False
        (nothing changed) sends the request down the general path."""
        params = req.sampling_params
        out_ids, all_ids = req.output_token_ids, req.all_token_ids
        num_out = len(out_ids) + 1
        if (
            (num_out >= params.min_tokens and ((tok in req.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids))
            or (params.max_tokens is not None and num_out >= params.max_tokens)
            or len(all_ids) + 1 >= req.max_model_len
        ):
            return False
        bs = self.config.block_size
        req.num_output_placeholders -= 1
        req.is_awaiting_verification = False
        out_ids.append(tok)
        all_ids.append(tok)
        if req.block_root and len(all_ids) // bs > len(req.block_hashes):
            extend_block_hashes(req.block_hashes, all_ids, bs, req.block_root, req.mm_spans)
        step = s.step
        end_pos = step.start_pos + len(step.token_ids)
        if req.status == RequestStatus.RUNNING and end_pos // bs > req.num_registered_blocks:
            self.kv.register_blocks(req, end_pos)
        return True

    # ---- block / slot bookkeeping -----------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput, ctx: _StepContext) -> None:
        self.running.remove(req)
        self.kv.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.window_start = req.write_from = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)
        out.preempted_ids.append(req.request_id)
        ctx.preempted_ids.add(req.request_id)

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.release(req)
        req.status = status
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---- invariants -------------------------------------------------------------------
    def check_integrity(self) -> None:
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is twice in running"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "requests map != running + waiting"
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than slots"
        assert [r.sort_key for r in self.running] == sorted(r.sort_key for r in self.running), "running out of order"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING and req.slot is not None, f"{req.request_id}: bad running state"
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{req.request_id}: bad waiting state"
            assert not req.block_ids and req.slot is None and req.num_computed_tokens == 0
        self.kv.check_integrity(self.running)


@dataclass(slots=True)
class _StepContext:
    budget: int
    features: StepFeatures
    time_target: float | None = None
    num_chunks: int = 0
    step_no: int = 0
    preempted_ids: set[str] = field(default_factory=set)


def _sort_key(req: Request) -> tuple[int, int]:
    return req.sort_key


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
