"""``Scheduler.schedule()``'s parts: what every request computes in the next step.

1. Priority preemption and admission (waiting -> running). Admission takes waiting requests in
   (priority, arrival) order. A request that does not fit (no slot, no blocks, no budget) stops
   admission, so later arrivals never overtake it; requests that cannot run yet for reasons of
   their own (a token still in flight, KV still being read from the store) step aside without
   holding the queue. An admitted request starts at its prefix-cache hit, minus the tokens
   replayed to rebuild its sliding-window state.
2. Running requests' share of a step: decodes first (cheap, latency-bound), then prefill chunks
   and speculative runs, each group in (priority, arrival) order. A request whose next chunk
   needs blocks the pool does not have preempts the worst running request not yet scheduled in
   this step (recompute: blocks + slot freed, back to waiting, generated tokens kept), possibly
   itself.
3. Emission: one request's share written into the SchedulerOutput, its state advanced. A
   request's SeqStep covers positions ``[start, start + n)`` of its tokens:

    start = num_computed_tokens                       start + n
    |-- known tokens --|-- placeholders --|-- drafts --|
                       ^ num_tokens        (tokens the step in flight is still sampling)

   Its logit rows are ``[prompt-logprob rows][sample rows]``; a step samples (1 + drafts rows)
   only when it reaches the last known-or-placeholder token. ``num_computed_tokens`` advances at
   once, so the next ``schedule()`` can run before this step's tokens are known (async scheduling).
"""

from __future__ import annotations

import bisect
from operator import attrgetter
from typing import TYPE_CHECKING

from deepinfer.engine.core.batch import SeqStep
from deepinfer.engine.core.request import Request, RequestStatus
from deepinfer.engine.sched.types import PLACEHOLDER_TOKEN_ID, ScheduledSeq, SchedulerOutput, StepBudget

if TYPE_CHECKING:
    from deepinfer.engine.sched.scheduler import Scheduler

_by_priority = attrgetter("sort_key")  # (priority, arrival): lower runs first, max() is the worst


# ---- 1. waiting -> running ---------------------------------------------------------------------
def preempt_for_priority(sched: Scheduler, out: SchedulerOutput, budget: StepBudget) -> None:
    """Let a strictly higher-priority waiting request displace the worst running ones while it
    is short of a slot or of blocks for its first chunk."""
    head = sched.waiting.peek()
    if head is None or head.num_output_placeholders > 0:
        return
    cfg = sched.config
    first_chunk = min(head.num_tokens, cfg.max_num_batched_tokens)
    num_blocks_needed = -(-first_chunk // cfg.block_size)
    while sched.running:
        is_short_of_slot = len(sched.running) >= cfg.max_num_seqs or sched.slots.num_free_slots == 0
        is_short_of_blocks = sched.pool.num_free_blocks < num_blocks_needed
        if not (is_short_of_slot or is_short_of_blocks):
            return
        victim = max(sched.running, key=_by_priority)
        if victim.priority <= head.priority:
            return
        sched.preempt(victim, out, budget)


def admit_waiting(sched: Scheduler, out: SchedulerOutput, budget: StepBudget) -> None:
    cfg = sched.config
    waiting = sched.waiting
    held_back: list[Request] = []
    while budget.num_tokens_left > 0 and len(waiting) > 0:
        req = waiting.peek()
        if req.num_output_placeholders > 0 or req.request_id in budget.preempted_ids:
            # Preempted with a sampled token still in flight (its id is unknown) or in this
            # very step: it waits one step.
            held_back.append(waiting.pop())
            continue
        if not sched.kv.is_kv_ready(req):
            # KV tiers (engine/kv/offload.py): its prefix blocks are still being read from
            # the store; it waits without holding the queue (a wait for KV, not a stall).
            held_back.append(waiting.pop())
            continue
        if len(sched.running) >= cfg.max_num_seqs or sched.slots.num_free_slots == 0:
            break
        hits = sched.kv.lookup_prefix(req)
        hit_len = len(hits) * cfg.block_size
        swa_slots = sched.swa_slots
        is_restored = swa_slots is not None and swa_slots.has_slot(req, hit_len)  # [swa-slots hook]
        if is_restored:
            num_replay = 0
        else:
            num_replay = hit_len if cfg.max_replay_tokens is None else min(hit_len, cfg.max_replay_tokens)
        start = hit_len - num_replay
        n = budget.chunk_size(start, req.num_tokens - start)
        if swa_slots is not None and n > 1:  # [swa-slots hook] end where a slot can be saved
            n = swa_slots.chunk_tokens(req, start, n, hit_len=hit_len)
        if n <= 0:
            break
        if not sched.kv.admit(req, hits, start + n):
            break
        waiting.pop()
        req.num_computed_tokens = start
        req.window_start = 0 if is_restored else start  # a restored slot holds the whole window
        req.write_from = hit_len
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit_len
        req.status = RequestStatus.RUNNING
        bisect.insort(sched.running, req, key=_by_priority)
        if swa_slots is not None:  # [swa-slots hook] queue the restore / note an approximate replay
            swa_slots.on_admit(req, hit_len, is_restored=is_restored)
        emit_chunk(req, n, [], out, budget)
    for req in held_back:
        waiting.push(req)


# ---- 2. running requests -------------------------------------------------------------------------
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
        step = SeqStep(req.seq_id, req.slot, req.block_ids, start, token_ids, 1, req.window_start, req.write_from,
                       req.mm_inputs)
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


# ---- 3. one request's share of the step -----------------------------------------------------------
def emit_decode(req: Request, out: SchedulerOutput, budget: StepBudget) -> None:
    """``emit_chunk`` for one known-or-placeholder token, no drafts, blocks already in place."""
    start = req.num_computed_tokens
    has_placeholder = start == len(req.all_token_ids)
    token_ids = [PLACEHOLDER_TOKEN_ID] if has_placeholder else [req.all_token_ids[start]]
    if has_placeholder:
        out.placeholders.append((req.request_id, token_ids, 0))
    step = SeqStep(req.seq_id, req.slot, req.block_ids, start, token_ids, 1, req.window_start, req.write_from,
                       req.mm_inputs)
    out.scheduled.append(ScheduledSeq(req.request_id, step, 0, 0, 1, start, 0, has_placeholder, req.num_preemptions))
    out.num_logits += 1
    req.num_computed_tokens = start + 1
    req.num_output_placeholders += 1
    req.scheduled_in = budget.step_no
    budget.num_tokens_left -= 1
    f = out.features
    f.num_seqs += 1
    f.sum_n += 1
    f.sum_np += start
    f.sum_n2 += 1


def emit_chunk(req: Request, n: int, drafts: list[int], out: SchedulerOutput, budget: StepBudget) -> None:
    """Append req's SeqStep for positions [start, start + n) (the last ``len(drafts)`` of them
    draft tokens to verify) and advance its state."""
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
        mm_inputs=req.mm_inputs,
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
    budget.num_tokens_left -= n
    req.scheduled_in = budget.step_no
    out.features.add(n, start)
    if n > 1:
        budget.num_chunks += 1
