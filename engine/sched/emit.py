"""Writing one request's share of a step into the SchedulerOutput and advancing its state.

A request's SeqStep covers positions ``[start, start + n)`` of its tokens:

    start = num_computed_tokens                       start + n
    |-- known tokens --|-- placeholders --|-- drafts --|
                       ^ num_tokens        (tokens the step in flight is still sampling)

Its logit rows are ``[prompt-logprob rows][sample rows]``; a step samples (1 + drafts rows) only
when it reaches the last known-or-placeholder token. ``num_computed_tokens`` advances at once, so
the next ``schedule()`` can run before this step's tokens are known (async scheduling).
"""

from __future__ import annotations

from deepinfer.engine.core.batch import SeqStep
from deepinfer.engine.core.request import Request
from deepinfer.engine.sched.budget import StepBudget
from deepinfer.engine.sched.types import PLACEHOLDER_TOKEN_ID, ScheduledSeq, SchedulerOutput


def emit_decode(req: Request, out: SchedulerOutput, budget: StepBudget) -> None:
    """``emit_chunk`` for one known-or-placeholder token, no drafts, blocks already in place."""
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
