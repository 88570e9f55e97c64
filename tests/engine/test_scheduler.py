from __future__ import annotations

import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.request import RequestStatus
from deepinfer.engine.sched.scheduler import (
    PLACEHOLDER_TOKEN_ID,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, **kw) -> Scheduler:
    cfg = SchedulerConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **kw)
    return Scheduler(cfg, BlockPool(num_blocks, block_size), SlotPool(max_num_seqs))


def add(s: Scheduler, rid: str, prompt, max_tokens=4, **params):
    return s.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), seed=0, eos_token_ids=[0])


def fake_sample(out: SchedulerOutput, token=7) -> dict[str, list[int]]:
    return {x.request_id: [token] for x in out.scheduled if x.num_sample_rows}


def step(s: Scheduler, token=7):
    out = s.schedule()
    ups = s.update_from_output(out, fake_sample(out, token))
    s.check_integrity()
    return out, ups


def by_id(out: SchedulerOutput):
    return {x.request_id: x for x in out.scheduled}


def test_chunked_prefill_then_decode_under_budget():
    s = make_scheduler(budget=10)
    add(s, "a", list(range(1, 24)), max_tokens=3)  # 23 prompt tokens
    out, ups = step(s)
    a = by_id(out)["a"]
    assert (a.step.start_pos, a.step.num_tokens, a.step.num_logits) == (0, 10, 0)
    assert ups[0].new_token_ids == []
    out, _ = step(s)
    assert by_id(out)["a"].step.start_pos == 10
    out, ups = step(s)  # last 3 prompt tokens: the final chunk samples
    a = by_id(out)["a"]
    assert (a.step.start_pos, a.step.num_tokens, a.step.num_logits) == (20, 3, 1)
    assert ups[0].new_token_ids == [7]
    out, ups = step(s)
    a = by_id(out)["a"]
    assert (a.step.start_pos, list(a.step.token_ids)) == (23, [7])
    out, ups = step(s)
    assert ups[0].finish_status == RequestStatus.FINISHED_LENGTH
    assert ups[0].request.output_token_ids == [7, 7, 7]
    assert not s.has_unfinished_requests() and s.pool.num_free_blocks == 64
    assert s.schedule().finished_ids == ["a"]


def test_mixed_step_decodes_first_and_budget_shared():
    s = make_scheduler(budget=8)
    add(s, "a", [1, 2, 3], max_tokens=10)
    step(s)  # a: prefill, samples
    add(s, "b", list(range(1, 21)))
    out, _ = step(s)
    ids = by_id(out)
    assert ids["a"].step.num_tokens == 1  # decode
    assert ids["b"].step.num_tokens == 7  # rest of the budget
    assert out.num_scheduled_tokens == 8


def test_fifo_within_priority_and_priority_order():
    s = make_scheduler(max_num_seqs=1, budget=100)
    add(s, "late-low", [1, 2], max_tokens=1, priority=5)
    add(s, "first", [1, 2], max_tokens=1)
    add(s, "second", [1, 2], max_tokens=1)
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled]
    assert order == ["first", "second", "late-low"]


def test_priority_preemption_displaces_worse_running_request():
    s = make_scheduler(max_num_seqs=1, budget=100)
    add(s, "low", [1, 2, 3], max_tokens=10, priority=3)
    step(s)
    add(s, "high", [4, 5], max_tokens=1, priority=0)
    out = s.schedule()
    assert out.preempted_ids == ["low"] and [x.request_id for x in out.scheduled] == ["high"]
    s.update_from_output(out, fake_sample(out))
    s.check_integrity()
    low = s.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.output_token_ids == [7]
    out, _ = step(s)  # low comes back and recomputes prompt + its generated token
    x = by_id(out)["low"]
    assert list(x.step.token_ids) == [1, 2, 3, 7] and x.step.start_pos == 0


def test_preemption_when_blocks_run_out_keeps_generated_tokens():
    # 2 sequences of 8 tokens need 2 blocks each; growing past 8 needs a third: only 5 blocks.
    s = make_scheduler(num_blocks=5, block_size=4, budget=100, enable_prefix_caching=False)
    add(s, "a", list(range(1, 8)), max_tokens=6)
    add(s, "b", list(range(11, 18)), max_tokens=6)
    preempted = []
    steps = 0
    while s.has_unfinished_requests() and steps < 50:
        out, _ = step(s)
        preempted += out.preempted_ids
        steps += 1
    assert "b" in preempted  # the later arrival is the victim
    assert not s.has_unfinished_requests()
    assert s.num_preemptions >= 1 and s.pool.num_free_blocks == 5


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=3, budget=1000)
    for i in range(5):
        add(s, f"r{i}", [1, 2, 3], max_tokens=5)
    out, _ = step(s)
    assert len(out.scheduled) == 3 and len(s.running) == 3 and len(s.waiting) == 2


def test_abort_frees_everything():
    s = make_scheduler()
    add(s, "a", list(range(1, 30)), max_tokens=100)
    add(s, "b", list(range(1, 30)), max_tokens=100)
    step(s)
    step(s)
    aborted = s.abort(["a", "b", "nope"])
    assert [r.request_id for r in aborted] == ["a", "b"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    s.check_integrity()
    assert s.pool.num_free_blocks == 64 and s.slots.num_free_slots == 8
    assert s.schedule().is_empty


def test_prefix_hit_replays_window_and_writes_from_hit():
    s = make_scheduler(block_size=4, budget=100, max_replay_tokens=6)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    add(s, "a", prompt, max_tokens=1)
    step(s)  # computes all 17, registers 4 blocks
    assert s.pool.num_cached_blocks == 4
    add(s, "b", prompt[:16] + [99, 98], max_tokens=1)
    out, ups = step(s)
    b = by_id(out)["b"]
    # hit P = 16 tokens, replay R = 6: positions [10, 18)
    assert (b.step.start_pos, b.step.window_start, b.step.write_from) == (10, 10, 16)
    assert list(b.step.token_ids) == prompt[10:16] + [99, 98]
    assert b.num_replay_tokens == 6 and ups[0].request.num_cached_tokens == 16
    # the whole prompt cached: the last block is recomputed anyway (logits need one token)
    add(s, "c", prompt[:16], max_tokens=1)
    out, _ = step(s)
    c = by_id(out)["c"]
    assert c.step.write_from == 12 and c.step.end_pos == 16 and c.step.num_logits == 1


def test_prefix_hit_replay_counts_against_budget_and_can_span_steps():
    s = make_scheduler(block_size=4, budget=5)  # replay everything (max_replay_tokens None)
    prompt = list(range(1, 14))
    add(s, "a", prompt, max_tokens=1)
    while s.has_unfinished_requests():
        step(s)
    add(s, "b", prompt, max_tokens=1)
    out, _ = step(s)
    b = by_id(out)["b"]
    assert (b.step.start_pos, b.step.num_tokens, b.step.write_from, b.step.num_logits) == (0, 5, 12, 0)
    out, _ = step(s)
    assert by_id(out)["b"].step.start_pos == 5 and by_id(out)["b"].step.window_start == 0
    out, ups = step(s)
    assert by_id(out)["b"].step.end_pos == 13 and ups[0].new_token_ids == [7]


def test_async_placeholder_scheduling():
    s = make_scheduler(budget=100)
    add(s, "a", [1, 2, 3], max_tokens=3)
    out1 = s.schedule()  # prefill, samples token 3
    out2 = s.schedule()  # scheduled before out1 is committed: decode with a placeholder
    a2 = by_id(out2)["a"]
    assert a2.has_placeholder and list(a2.step.token_ids) == [PLACEHOLDER_TOKEN_ID] and a2.step.start_pos == 3
    s.update_from_output(out1, {"a": [11]})
    s.check_integrity()
    out3 = s.schedule()
    assert by_id(out3)["a"].step.start_pos == 4
    s.update_from_output(out2, {"a": [12]})
    # the third token is in flight: max_tokens reached counting placeholders -> nothing scheduled
    assert s.schedule().is_empty
    ups = s.update_from_output(out3, {"a": [13]})
    assert ups[0].finish_status == RequestStatus.FINISHED_LENGTH
    assert ups[0].request.output_token_ids == [11, 12, 13]
    s.check_integrity()


def test_async_preempted_request_keeps_token_in_flight():
    s = make_scheduler(max_num_seqs=1, budget=100)
    add(s, "low", [1, 2, 3], max_tokens=5, priority=1)
    out1 = s.schedule()
    add(s, "high", [4, 5], max_tokens=1)
    out2 = s.schedule()  # preempts low while out1 is in flight
    assert out2.preempted_ids == ["low"]
    s.update_from_output(out1, {"low": [21]})  # stale epoch: token kept, no block bookkeeping
    s.check_integrity()
    low = s.requests["low"]
    assert low.output_token_ids == [21] and low.num_computed_tokens == 0 and low.num_output_placeholders == 0
    s.update_from_output(out2, {"high": [0]})  # EOS
    out3 = s.schedule()
    assert list(by_id(out3)["low"].step.token_ids) == [1, 2, 3, 21]


def test_finished_while_next_step_in_flight_is_dropped():
    s = make_scheduler(budget=100)
    add(s, "a", [1, 2, 3], max_tokens=10)
    out1 = s.schedule()
    out2 = s.schedule()
    ups = s.update_from_output(out1, {"a": [0]})  # EOS
    assert ups[0].finish_status == RequestStatus.FINISHED_STOPPED
    assert s.update_from_output(out2, {"a": [5]}) == []
    s.check_integrity()


def test_speculative_rollback_frees_blocks():
    s = make_scheduler(block_size=4, budget=100, max_num_spec_tokens=5, enable_prefix_caching=False)
    req = add(s, "a", [1, 2, 3], max_tokens=20)
    step(s)  # prefill -> token 7, 4 tokens known
    req.spec_token_ids = [8, 9, 10, 11, 12]
    out = s.schedule()
    a = by_id(out)["a"]
    assert list(a.step.token_ids) == [7, 8, 9, 10, 11, 12] and a.step.num_logits == 6
    assert len(req.block_ids) == 3  # positions [0, 9)
    assert s.schedule().is_empty  # awaiting verification: nothing more for it
    ups = s.update_from_output(out, {"a": [8, 30]})  # one draft accepted + a correction
    assert ups[0].num_rejected == 4 and req.output_token_ids == [7, 8, 30]
    assert req.num_computed_tokens == 5 and req.num_tokens == 6
    assert len(req.block_ids) == 2  # blocks past position 6 freed
    s.check_integrity()
    out = s.schedule()
    assert by_id(out)["a"].step.start_pos == 5 and list(by_id(out)["a"].step.token_ids) == [30]


def test_stop_token_in_accepted_drafts_truncates():
    s = make_scheduler(max_num_spec_tokens=3)
    req = add(s, "a", [1, 2], max_tokens=20, stop_token_ids=[9])
    step(s)
    req.spec_token_ids = [5, 9, 6]
    out = s.schedule()
    ups = s.update_from_output(out, {"a": [5, 9, 6, 4]})
    assert ups[0].new_token_ids == [5, 9] and ups[0].finish_status == RequestStatus.FINISHED_STOPPED
    assert ups[0].request.stop_reason == 9


def test_prompt_logprob_rows():
    s = make_scheduler(budget=4)
    add(s, "a", [1, 2, 3, 4, 5, 6], max_tokens=1, prompt_logprobs=2)
    out, _ = step(s)
    a = by_id(out)["a"]
    assert (a.first_prompt_logprob_row, a.num_prompt_logprob_rows, a.num_sample_rows, a.step.num_logits) == (0, 4, 0, 4)
    out, _ = step(s)
    a = by_id(out)["a"]
    # rows 4 (scores token 5) then the sample row at position 5
    assert (a.first_prompt_logprob_row, a.num_prompt_logprob_rows, a.num_sample_rows, a.step.num_logits) == (4, 1, 1, 2)


def test_bad_requests_are_rejected():
    s = make_scheduler(max_model_len=8)
    with pytest.raises(SchedulerError, match="empty"):
        add(s, "a", [])
    with pytest.raises(SchedulerError, match="max_model_len"):
        add(s, "a", list(range(8)))
    add(s, "a", [1])
    with pytest.raises(SchedulerError, match="already in use"):
        add(s, "a", [1])


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=6)
    add(s, "a", [1, 2, 3, 4], max_tokens=100)
    ups = []
    while s.has_unfinished_requests():
        ups += step(s)[1]
    assert ups[-1].finish_status == RequestStatus.FINISHED_LENGTH and ups[-1].request.num_tokens == 6
