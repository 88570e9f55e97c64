"""KV tiers on one engine (real tiny DeepSeek-V4 runner): block codec round trip, write-behind
into the host tier, a host-tier hit after the device pool evicted the prefix, an fs store hit on a
fresh engine, and the scheduler keeping a request waiting (without stalling others) while its
blocks load."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from deepinfer.cache.kv_block_codec import BlockCodec, BlockCodecError
from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE
from deepinfer.cache.store.fs_backend import FsStore
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from deepinfer.engine.kv.tier_metrics import KVTierCollector
from tests.conftest import load_test_helper

pytestmark = pytest.mark.timeout(300)


h = load_test_helper("engine/kv_tiers_harness")
PROMPT_LEN = 600  # 4 full blocks can hit ((600 - 1) // 128), 5 blocks with the outputs


@pytest.fixture(scope="module")
def reference():
    """Outputs of plain engines (no tiers) for the prompts used below."""
    runner = h.make_runner(num_blocks=8)
    core = h.make_core(runner, 8, None)
    outs = h.generate(core, [(f"p{s}", h.prompt(s, PROMPT_LEN), h.greedy(6)) for s in (1, 2)])
    return {rid: list(o.outputs[0].token_ids) for rid, o in outs.items()}


def test_block_codec_round_trips_every_tensor_and_refuses_a_foreign_layout():
    runner = h.make_runner(num_blocks=4)
    codec = BlockCodec.from_kv_layout(runner.kv_layout())
    g = torch.Generator().manual_seed(0)
    stacked = {s.key: torch.randn((2, *s.shape), generator=g).to(s.dtype) for s in codec.specs}
    payloads = codec.pack_many(stacked)
    assert [len(p) for p in payloads] == [codec.num_bytes] * 2 == [runner.kv_layout().bytes_per_block] * 2
    back = codec.unpack_many(payloads)
    assert all(torch.equal(back[k], stacked[k]) for k in stacked)
    with pytest.raises(BlockCodecError, match="bytes"):
        codec.unpack(payloads[0][:-4])
    other = BlockCodec([*codec.specs[:-1]])
    assert other.fingerprint != codec.fingerprint


def test_host_tier_hit_after_the_device_pool_evicted_the_prefix(reference):
    num_blocks = 6  # one 600-token request fills 5: a second prompt must evict the first's blocks
    runner = h.make_runner(num_blocks)
    offload = KVOffload.build(runner, host_capacity_bytes=1 << 20, config=KVOffloadConfig())
    try:
        core = h.make_core(runner, num_blocks, offload)
        first = h.generate(core, [("a1", h.prompt(1, PROMPT_LEN), h.greedy(6))])["a1"]
        assert first.metrics.cached_tokens_by_tier == {TIER_DEVICE: 0, TIER_HOST: 0, TIER_STORE: 0}
        h.generate(core, [("b", h.prompt(2, PROMPT_LEN), h.greedy(6))])
        assert offload.wait_for_writes(30)
        assert offload.tiers.host_stats().num_blocks == 8  # 4 full prompt blocks of each prompt
        pool = core.scheduler.pool
        again = h.generate(core, [("a2", h.prompt(1, PROMPT_LEN), h.greedy(6))])["a2"]
        split = again.metrics.cached_tokens_by_tier
        assert again.num_cached_tokens == 4 * h.BLOCK_SIZE
        assert split[TIER_HOST] >= h.BLOCK_SIZE and split[TIER_STORE] == 0
        assert split[TIER_DEVICE] + split[TIER_HOST] == again.num_cached_tokens
        assert offload.stats.num_loaded_host == split[TIER_HOST] // h.BLOCK_SIZE
        # the loaded KV is the computed KV: identical greedy tokens to a plain engine
        assert list(first.outputs[0].token_ids) == reference["p1"]
        assert list(again.outputs[0].token_ids) == reference["p1"]
        pool.check_integrity()
        offload.tiers.host.check_integrity()
        # the same figures on the engine's /metrics
        registry = CollectorRegistry(auto_describe=False)
        registry.register(KVTierCollector(offload, "e0"))
        loaded = registry.get_sample_value("deepinfer_kv_loaded_host_blocks_total", {"engine": "e0"})
        assert loaded == offload.stats.num_loaded_host
        assert registry.get_sample_value("deepinfer_kv_host_blocks", {"engine": "e0"}) == 8
    finally:
        offload.close()


def test_fs_store_hit_on_a_fresh_engine_and_waiting_for_kv_does_not_stall_others(tmp_path, reference):
    num_blocks = 16
    runner1 = h.make_runner(num_blocks)
    off1 = KVOffload.build(runner1, store=FsStore(tmp_path / "kv"))
    try:
        core1 = h.make_core(runner1, num_blocks, off1)
        h.generate(core1, [("w", h.prompt(1, PROMPT_LEN), h.greedy(6))])
        assert off1.wait_for_writes(30)
        assert off1.stats.num_written_store >= 4 and off1.stats.num_store_write_failures == 0
    finally:
        off1.close()

    runner2 = h.make_runner(num_blocks)
    off2 = KVOffload.build(runner2, store=FsStore(tmp_path / "kv"), config=KVOffloadConfig(load_deadline_s=5.0))
    try:
        core2 = h.make_core(runner2, num_blocks, off2)
        # prompt 2 is in no tier: its store read misses, then it is computed (device-resident)
        first = h.generate(core2, [("other1", h.prompt(2, PROMPT_LEN), h.greedy(6))])["other1"]
        assert first.num_cached_tokens == 0 and off2.stats.num_store_reads == 1
        # Prompt 1 waits for its store read (the first schedule only starts it) while prompt 2,
        # all device hits, is admitted at once: waiting for KV never stalls the step.
        core2.add_request("hit", h.prompt(1, PROMPT_LEN), h.greedy(6))
        core2.add_request("other2", h.prompt(2, PROMPT_LEN), h.greedy(6))
        plan = core2.schedule_step()
        assert [s.request_id for s in plan.sched.scheduled] == ["other2"]
        assert [r.request_id for r in core2.scheduler.waiting] == ["hit"]
        assert off2.num_pending_loads == 1
        logits = core2.execute(plan)
        done = {o.request_id: o for o in core2.commit_step(plan, core2.sample_step(plan, logits))}
        for rid, out in h.generate(core2, []).items():
            done[rid] = h.merge_output(done.get(rid), out)
        hit, other = done["hit"], done["other2"]
        assert hit.num_cached_tokens == 4 * h.BLOCK_SIZE
        assert hit.metrics.cached_tokens_by_tier == {TIER_DEVICE: 0, TIER_HOST: 0, TIER_STORE: 4 * h.BLOCK_SIZE}
        assert other.metrics.cached_tokens_by_tier == {TIER_DEVICE: 4 * h.BLOCK_SIZE, TIER_HOST: 0, TIER_STORE: 0}
        assert list(hit.outputs[0].token_ids) == reference["p1"]
        assert list(other.outputs[0].token_ids) == reference["p2"]
        assert off2.stats.num_loaded_store == 4 and off2.stats.num_deadline_misses == 0
    finally:
        off2.close()
