"""Committing a finished step: accepted tokens in, rejected drafts rolled back, stops applied.

A step's accepted tokens are 1 + the number of accepted drafts per request with sample rows. Fewer
than scheduled roll ``num_computed_tokens`` back (every cache row is position-addressed, so the
rejected positions are simply overwritten later, see engine/core/batch.py) and free blocks past the need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from deepinfer.cache.block_hash import extend_block_hashes
from deepinfer.engine.core.request import Request, RequestStatus, check_token_stop
from deepinfer.engine.sched.types import RequestUpdate, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.engine.sched.scheduler import Scheduler


def commit_step(
    sched: Scheduler, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
) -> list[RequestUpdate]:
    """The body of ``Scheduler.update_from_output`` (its docstring says what is committed)."""
    bs = sched.config.block_size
    updates: list[RequestUpdate] = []
    requests = sched.requests
    for s in output.scheduled:
        req = requests.get(s.request_id)
        if req is None:
            continue
        is_stale = req.num_preemptions != s.preemption_epoch
        if s.num_sample_rows == 1 and not s.num_prompt_logprob_rows and not is_stale:
            tokens = sampled.get(s.request_id)
            if tokens is not None and len(tokens) == 1 and _commit_one_token(sched, req, s, tokens[0]):
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
            sched.kv.register_blocks(req, s.step.end_pos - num_rejected)
            if num_rejected:
                sched.kv.trim_blocks(req)
        if stop.status is not None:
            sched.finish(req, stop.status, stop.stop_reason)
        updates.append(RequestUpdate(req, kept, num_rejected, stop.status))
    return updates


def _commit_one_token(sched: Scheduler, req: Request, s: ScheduledSeq, tok: int) -> bool:
    """Fast path of ``commit_step`` for one sampled token that stops nothing; False (nothing
    changed) sends the request down the general path."""
    params = req.sampling_params
    out_ids, all_ids = req.output_token_ids, req.all_token_ids
    num_out = len(out_ids) + 1
    if (
        (num_out >= params.min_tokens and ((tok in req.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids))
        or (params.max_tokens is not None and num_out >= params.max_tokens)
        or len(all_ids) + 1 >= req.max_model_len
    ):
        return False
    bs = sched.config.block_size
    req.num_output_placeholders -= 1
    req.is_awaiting_verification = False
    out_ids.append(tok)
    all_ids.append(tok)
    if req.block_root and len(all_ids) // bs > len(req.block_hashes):
        extend_block_hashes(req.block_hashes, all_ids, bs, req.block_root, req.mm_spans)
    step = s.step
    end_pos = step.start_pos + len(step.token_ids)
    if req.status == RequestStatus.RUNNING and end_pos // bs > req.num_registered_blocks:
        sched.kv.register_blocks(req, end_pos)
    return True
