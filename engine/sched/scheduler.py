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

This class owns the state (requests, queues, pools), its bookkeeping and the commit of a step
(``update_from_output``: accepted tokens in, rejected drafts rolled back, stops applied); beside it
  schedule.py   schedule(): priority preemption, running requests, admission, each request's SeqStep
  types.py      the values they pass around (config, the step's plan and budget, the waiting queue)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.request import Request, RequestStatus, check_token_stop
from deepinfer.engine.kv.manager import KVManager
from deepinfer.engine.sched.cost_model import CostModel
from deepinfer.engine.sched.schedule import admit_waiting, preempt_for_priority, schedule_running
from deepinfer.engine.sched.types import (
    PLACEHOLDER_TOKEN_ID,
    RequestUpdate,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
    StepBudget,
    WaitingQueue,
)

if TYPE_CHECKING:
    from deepinfer.engine.kv.offload import KVOffload
    from deepinfer.engine.mm.inputs import MultiModalInput
    from deepinfer.engine.kv.swa_slots import SwaSlotManager

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
        *,
        swa_slots: SwaSlotManager | None = None,
        kv_offload: KVOffload | None = None,
    ) -> None:
        """``swa_slots`` / ``kv_offload``: the core's parts (engine/core/hooks.py), given here."""
        if block_pool.block_size != config.block_size:
            raise SchedulerError(f"block pool block_size {block_pool.block_size} != config {config.block_size}")
        self.config = config
        self.kv = KVManager(block_pool, slot_pool, offload=kv_offload, swa_slots=swa_slots)
        self.pool = block_pool
        self.slots = slot_pool
        self.cost_model = cost_model
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._num_arrivals = 0
        self._next_seq_id = 0
        # [swa-slots hook] engine/kv/swa_slots.py SwaSlotManager: restore a stored SWA slot at the
        # prefix-hit boundary instead of replaying (None: always replay)
        self.swa_slots = swa_slots
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
        mm_inputs: Sequence[MultiModalInput] = (),
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
            mm_spans=tuple(mm.span for mm in mm_inputs),
            mm_inputs=tuple(mm_inputs),
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
                self.finish(req, status, stop_reason)
                done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


    # ---- the two verbs ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self._num_schedules += 1
        budget = StepBudget.for_step(self.config, self.cost_model, out.features, self._num_schedules)

        preempt_for_priority(self, out, budget)
        num_priority_preemptions = len(out.preempted_ids)
        schedule_running(self, out, budget)
        # a step that had to preempt for blocks admits nobody: the pool is short
        if len(out.preempted_ids) == num_priority_preemptions:
            admit_waiting(self, out, budget)
        if self.cost_model is not None and self.cost_model.is_fitted:
            out.predicted_time_s = self.cost_model.predict(out.features)
        return out

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        """Commit a finished step. ``sampled[request_id]`` holds the accepted tokens of every
        request with sample rows: 1 + the number of accepted drafts (fewer than scheduled rolls
        ``num_computed_tokens`` back and frees blocks past the need). Requests finished or
        aborted since ``schedule()`` are skipped; a request preempted since then (stale epoch)
        keeps the tokens it sampled (they were computed from valid state) and nothing else.
        Rolling back is exact: every cache row is position-addressed, so rejected positions are
        simply overwritten later (engine/core/batch.py)."""
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
                self.finish(req, stop.status, stop.stop_reason)
            updates.append(RequestUpdate(req, kept, num_rejected, stop.status))
        return updates

    def _commit_one_token(self, req: Request, s: ScheduledSeq, tok: int) -> bool:
        """Fast path of ``update_from_output`` for one sampled token that stops nothing; False
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

    # ---- block / slot bookkeeping (the step builders call these) ----------------------
    def preempt(self, req: Request, out: SchedulerOutput, budget: StepBudget) -> None:
        """Recompute preemption: free req's blocks and slot and send it back to waiting; the
        tokens it generated are kept and recomputed after readmission."""
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
        budget.preempted_ids.add(req.request_id)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
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
