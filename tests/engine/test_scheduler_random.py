"""Random workloads against the bare scheduler: invariants hold after every call, nothing leaks."""

from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.slot_pool import SlotPool
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sched.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig


def accepted_for(out, rng, vocab=16):
    res = {}
    for x in out.scheduled:
        if not x.num_sample_rows:
            continue
        drafts = list(x.step.token_ids[len(x.step.token_ids) - x.num_draft_tokens:]) if x.num_draft_tokens else []
        n_ok = rng.randint(0, len(drafts))
        res[x.request_id] = drafts[:n_ok] + [rng.randrange(vocab)]
    return res


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_integrity(mode, seed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 32, 128]),
                          max_model_len=120, max_replay_tokens=rng.choice([None, 6]), max_num_spec_tokens=3)
    s = Scheduler(cfg, BlockPool(30, 4), SlotPool(6))
    prefixes = [[rng.randrange(2, 16) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    num_added = 0
    in_flight = None
    for it in range(400):
        if num_added < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randint(1, 24)] + [rng.randrange(2, 16) for _ in range(rng.randint(0, 20))]
            params = SamplingParams(max_tokens=rng.randint(1, 30), priority=rng.choice([0, 0, 1, 2]),
                                    prompt_logprobs=1 if rng.random() < 0.1 else None)
            s.add_request(f"r{num_added}", prompt or [3], params, seed=0, eos_token_ids=[0])
            num_added += 1
        if s.requests and rng.random() < 0.05:
            s.abort([rng.choice(list(s.requests))])
        if mode == "sync":
            for req in s.running:  # propose drafts for pure decodes
                if rng.random() < 0.5 and req.num_computed_tokens == req.num_tokens - 1:
                    req.spec_token_ids = [rng.randrange(16) for _ in range(rng.randint(1, 3))]
            out = s.schedule()
            s.check_integrity()
            assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
            s.update_from_output(out, accepted_for(out, rng))
        else:
            out = s.schedule()  # scheduled while the previous step is "in flight"
            s.check_integrity()
            if in_flight is not None:
                prev_tokens = accepted_for(in_flight, rng)
                for x in out.scheduled:  # the engine fills placeholders before launching
                    if x.has_placeholder:
                        ids = x.step.token_ids
                        ids[ids.index(PLACEHOLDER_TOKEN_ID)] = prev_tokens.get(x.request_id, [0])[-1]
                s.update_from_output(in_flight, prev_tokens)
            in_flight = out
        s.check_integrity()
        for x in out.scheduled:
            st = x.step
            assert len(st.block_table) * cfg.block_size >= st.end_pos
            assert st.window_start <= st.start_pos or st.window_start == 0
    # drain
    while s.has_unfinished_requests() or in_flight is not None:
        out = s.schedule()
        if mode == "async" and in_flight is not None:
            s.update_from_output(in_flight, accepted_for(in_flight, rng))
            in_flight = out if not out.is_empty else None
        else:
            s.update_from_output(out, accepted_for(out, rng))
        s.check_integrity()
        it += 1
        assert it < 5000
    assert s.pool.num_free_blocks == 30 and s.slots.num_free_slots == 6
