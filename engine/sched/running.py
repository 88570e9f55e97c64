"""Running requests' share of a step: decodes first (cheap, latency-bound), then prefill chunks
and speculative runs, each group in (priority, arrival) order.

A request whose next chunk needs blocks the pool does not have preempts the worst running request
not yet scheduled in this step (recompute: blocks + slot freed, back to waiting, generated tokens
kept), possibly itself.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from deepinfer.engine.core.batch import SeqStep
from deepinfer.engine.core.request import Request, RequestStatus
from deepinfer.engine.sched.budget import StepBudget
from deepinfer.engine.sched.emit import emit_chunk, emit_decode
from deepinfer.engine.sched.types import PLACEHOLDER_TOKEN_ID, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.engine.sched.scheduler import Scheduler

_by_priority = attrgetter("sort_key")  # (priority, arrival): max() is the worst


def schedule_running(sched: Scheduler, out: SchedulerOutput, budget: StepBudget) -> None:
    # sched.running is kept in (priority, arrival) order: decodes first, then chunks
    decodes, chunks = [], []
    for req in sched.running:
        (decodes if len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens <= 1
         else chunks).append(req)
    if _schedule_decodes(sched, decodes, out, budget):
        for req in chunks:
            if budget.num_tokens_left <= 0:
                break
            schedule_one_running(sched, req, out, budget)


def _schedule_decodes(sched: Scheduler, decodes: list[Request], out: SchedulerOutput, budget: StepBudget) -> bool:
    """Schedule running requests with at most one token to compute; False when the budget ran
    out. A plain decode (one known-or-placeholder token, no drafts, blocks already in place, not
    at a length limit) is emitted inline, the rest go through ``schedule_one_running``: at batch
    256 this loop is most of ``schedule()``."""
    bs = sched.config.block_size
    step_no = budget.step_no
    scheduled, placeholders = out.scheduled, out.placeholders
    f = out.features
    running = RequestStatus.RUNNING
    for req in decodes:
        if budget.num_tokens_left <= 0:
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
            schedule_one_running(sched, req, out, budget)
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
        budget.num_tokens_left -= 1
        out.num_logits += 1
        f.num_seqs += 1
        f.sum_n += 1
        f.sum_np += start
        f.sum_n2 += 1
    return budget.num_tokens_left > 0


def schedule_one_running(sched: Scheduler, req: Request, out: SchedulerOutput, budget: StepBudget) -> None:
    """One running request's share of the step (any kind: decode, chunk, drafts)."""
    cfg = sched.config
    if req.status != RequestStatus.RUNNING or req.is_awaiting_verification:
        return
    num_new = req.num_tokens_with_placeholders - req.num_computed_tokens
    if num_new <= 0 or req.has_reached_length_limit:
        return
    if num_new == 1 and not req.spec_token_ids and (req.num_computed_tokens + 1) <= len(req.block_ids) * cfg.block_size:
        emit_decode(req, out, budget)
        return
    drafts: list[int] = []
    if num_new == 1 and req.num_output_placeholders == 0 and req.spec_token_ids:
        drafts = req.spec_token_ids[: cfg.max_num_spec_tokens]
    n = budget.chunk_size(req.num_computed_tokens, num_new + len(drafts))
    if sched.swa_slots is not None and n > 1 and not drafts:  # [swa-slots hook] end where a slot can be saved
        n = sched.swa_slots.chunk_tokens(req, req.num_computed_tokens, n)
    if n <= 0:
        return
    end = req.num_computed_tokens + n
    if -(-end // cfg.block_size) > len(req.block_ids):
        # Copy on grow: the step in flight holds the current list as its block table and
        # the runner reads it on the device thread while this one appends.
        req.block_ids = list(req.block_ids)
    while not sched.kv.ensure_blocks(req, end):
        victim = max((r for r in sched.running if r.scheduled_in != budget.step_no), key=_by_priority)
        sched.preempt(victim, out, budget)
        if victim is req:
            break
    if req.status == RequestStatus.RUNNING:
        emit_chunk(req, n, drafts[: max(0, n - num_new)], out, budget)
