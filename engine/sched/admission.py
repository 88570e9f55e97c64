"""Waiting -> running: priority preemption and head-of-line admission.

Admission takes waiting requests in (priority, arrival) order. A request that does not fit (no
slot, no blocks, no budget) stops admission, so later arrivals never overtake it; requests that
cannot run yet for reasons of their own (a token still in flight, KV still being read from the
store) step aside without holding the queue. An admitted request starts at its prefix-cache hit,
minus the tokens replayed to rebuild its sliding-window state.
"""

from __future__ import annotations

import bisect
from operator import attrgetter
from typing import TYPE_CHECKING

from deepinfer.engine.core.request import Request, RequestStatus
from deepinfer.engine.sched.budget import StepBudget
from deepinfer.engine.sched.emit import emit_chunk
from deepinfer.engine.sched.types import SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.engine.sched.scheduler import Scheduler

_by_priority = attrgetter("sort_key")  # (priority, arrival): lower runs first


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
