"""SWA slots in one engine: snapshot at block boundaries, save at finish/preempt, restore at a
prefix hit (no replay), exact vs bounded replay, approximate blocks kept out of the prefix cache."""

from __future__ import annotations

import random

import pytest

runner_mod = pytest.importorskip("deepinfer.engine.core.model_runner")
testing = pytest.importorskip("deepinfer.engine.models.deepseek_v4.testing")

from deepinfer.engine.api.sampling_params import SamplingParams  # noqa: E402
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig  # noqa: E402
from deepinfer.engine.core.hooks import EngineHooks  # noqa: E402
from deepinfer.engine.kv.swa_replay import plan_rebuild, snapshot_boundary, snapshot_chunk_end  # noqa: E402
from deepinfer.engine.kv.swa_slots import build_swa_slots  # noqa: E402
from deepinfer.engine.sched.scheduler import SchedulerConfig  # noqa: E402
from deepinfer.engine.text.output_processor import merge_output  # noqa: E402
from tests.conftest import load_test_helper  # noqa: E402

sync_steps = load_test_helper("bench/sync_steps")

BS = 16  # the reference model: 4 layers, window 16 -> exact replay = 64 tokens


@pytest.fixture(scope="module")
def ref():
    return testing.hf_reference(seed=3, layer_types=[testing.SLIDING, testing.CSA, testing.HCA, testing.CSA], hc_mult=2)


def make_core(ref, *, prefix_caching=True, num_blocks=64, max_num_seqs=4, budget=4096, swa=None) -> EngineCore:
    """``swa``: build_swa_slots options; the core is built with those SWA slots (core.hooks.swa_slots)."""
    cfg = ref.config
    runner = runner_mod.ModelRunner(cfg, ref.state_dict, num_blocks=num_blocks, num_slots=max_num_seqs, block_size=BS)
    sched = SchedulerConfig(block_size=BS, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                            enable_prefix_caching=prefix_caching, model_id="tiny-v4")
    hooks = EngineHooks()
    if swa is not None:
        parts = build_swa_slots(runner, sched, **swa)
        runner, sched, hooks = parts.runner, parts.scheduler, EngineHooks(swa_slots=parts.manager)
    return EngineCore(runner, EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size),
                      seed_rng=random.Random(0), hooks=hooks)


def run(core, reqs, max_steps=500):
    acc = {}
    for rid, prompt, n in reqs:
        core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for out in sync_steps.step(core):
            acc[out.request_id] = merge_output(acc.get(out.request_id), out)
        core.check_integrity()
    return {rid: list(o.outputs[0].token_ids) for rid, o in acc.items()}


def tokens(seed, n, vocab):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_policy_boundaries_and_plans():
    assert snapshot_boundary(64, 64, 16, 6) == 64
    assert snapshot_boundary(70, 70, 16, 6) == 64  # up to lookahead past: still the state at 64
    assert snapshot_boundary(71, 71, 16, 6) is None
    assert snapshot_boundary(66, 63, 16, 6) is None  # drafts above 63: only 48 is known, and it is overwritten
    assert snapshot_boundary(5, 5, 16, 6) is None
    assert plan_rebuild(256, has_slot=True, max_replay=128) == plan_rebuild(256, has_slot=True, max_replay=None)
    p = plan_rebuild(256, has_slot=False, max_replay=128)
    assert (p.num_replay_tokens, p.window_start, p.write_from, p.is_restored) == (128, 128, 256, False)
    assert plan_rebuild(96, has_slot=False, max_replay=128).window_start == 0
    # a prompt chunk is cut at the known tokens' last boundary only when it would end > lookahead past it
    assert snapshot_chunk_end(0, 75, 75, 16, 6) == 64
    assert snapshot_chunk_end(0, 70, 70, 16, 6) == 70  # 6 past 64: the rings still hold its state
    assert snapshot_chunk_end(64, 75, 75, 16, 6) == 75  # starts at the boundary: nothing to cut
    assert snapshot_chunk_end(0, 40, 75, 16, 6) == 40  # does not reach 64
    assert snapshot_chunk_end(10, 100, 100, 16, 6) == 100 and snapshot_chunk_end(10, 103, 103, 16, 6) == 96


@pytest.mark.timeout(300)
def test_multi_turn_restores_local_slot_without_replay(ref):
    vocab = ref.config.vocab_size
    p1 = tokens(0, 58, vocab)
    # lossless window rows: the restored state must give exactly the tokens of a full prefill
    core = make_core(ref, swa=dict(mode="bounded", num_store_slots=8, is_window_mxfp8=False))
    mgr = core.hooks.swa_slots
    o1 = run(core, [("t1", p1, 9)])["t1"]
    assert mgr.stats.num_saved == 1 and mgr.store.stored_boundaries()[0][1] == 64  # 67 tokens: boundary 64
    p2 = p1 + o1 + tokens(1, 10, vocab)
    o2 = run(core, [("t2", p2, 6)])["t2"]
    assert mgr.stats.num_restored == 1
    assert mgr.stats.num_replayed_tokens == 0 and mgr.stats.num_replayed_exact == mgr.stats.num_replayed_bounded == 0
    nocache = make_core(ref, prefix_caching=False)
    assert o2 == run(nocache, [("t2", p2, 6)])["t2"]
    mgr.store.check_integrity()

    # MXFP8 slots restore the same way (the values are quantised, so tokens may drift later)
    core8 = make_core(ref, swa=dict(mode="bounded", num_store_slots=8))
    mgr8 = core8.hooks.swa_slots
    assert run(core8, [("t1", p1, 9)])["t1"] == o1
    o2_mx = run(core8, [("t2", p2, 6)])["t2"]
    assert mgr8.stats.num_restored == 1 and mgr8.stats.num_replayed_tokens == 0 and len(o2_mx) == 6
    assert o2_mx[0] == o2[0]


@pytest.mark.timeout(300)
def test_exact_replay_equals_no_cache_and_bounded_stays_out_of_prefix_cache(ref):
    vocab = ref.config.vocab_size
    prefix = tokens(2, 112, vocab)  # 7 blocks: a hit of 96-112 tokens, more than the 64 of an exact replay
    first, second = prefix + tokens(3, 9, vocab), prefix + tokens(4, 11, vocab)
    want = run(make_core(ref, prefix_caching=False), [("b", second, 10)])["b"]

    exact = make_core(ref, swa=dict(mode="exact", num_store_slots=0))
    mgr = exact.hooks.swa_slots
    run(exact, [("a", first, 4)])
    assert run(exact, [("b", second, 10)])["b"] == want
    assert mgr.stats.num_replayed_exact == 1 and mgr.stats.num_replayed_tokens == 64

    bounded = make_core(ref, swa=dict(mode="bounded", replay_tokens=16, num_store_slots=0))
    mgr_b = bounded.hooks.swa_slots
    run(bounded, [("a", first, 4)])
    num_cached = bounded.scheduler.pool.num_cached_blocks if hasattr(bounded.scheduler.pool, "num_cached_blocks") else None
    got = run(bounded, [("b", second, 10)])["b"]
    assert mgr_b.stats.num_replayed_bounded == 1 and mgr_b.stats.num_replayed_tokens == 16
    assert len(got) == 10  # still answers (approximate state)
    # blocks past the hit computed over the approximate state never entered the prefix cache
    hashes_b = mgr_b.prefix_hashes(second + got)
    hit = bounded.scheduler.pool.lookup_prefix(hashes_b)
    assert len(hit) == len(bounded.scheduler.pool.lookup_prefix(mgr_b.prefix_hashes(prefix)))
    if num_cached is not None:
        assert bounded.scheduler.pool.num_cached_blocks == num_cached


@pytest.mark.timeout(300)
def test_preempted_sequence_resumes_from_its_saved_slot(ref):
    vocab = ref.config.vocab_size
    reqs = [(f"r{i}", tokens(10 + i, 30 + 7 * i, vocab), 40) for i in range(3)]
    want = run(make_core(ref, prefix_caching=False), reqs)
    core = make_core(ref, num_blocks=9, max_num_seqs=3, budget=64,  # too few blocks: preemption
                     swa=dict(mode="bounded", num_store_slots=8, is_window_mxfp8=False))
    mgr = core.hooks.swa_slots
    got = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    assert mgr.stats.num_saved > 0 and mgr.stats.num_restored > 0
    assert got == want
    mgr.store.check_integrity()
