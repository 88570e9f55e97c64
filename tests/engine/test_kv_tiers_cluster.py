"""KV tiers over a real storage cluster (6 daemons on loopback, k=4 m=2): two engine processes
share one store (a 2,000-token prompt computed by the first is a store hit on the second with
identical greedy tokens), and a slow or dead store falls back to recompute with the same tokens."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE
from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
from deepinfer.cache.store.ec import ECConfig
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from deepinfer.transport.protocol import DebugSet
from tests.conftest import load_test_helper

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

NUM_NODES, K, M = 6, 4, 2
HARNESS = Path(__file__).with_name("kv_tiers_harness.py")


h = load_test_helper("engine/kv_tiers_harness")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("kvstore"), NUM_NODES, extra_args=["--debug-hooks"]) as c:
        yield c


def _store_config() -> ClusterStoreConfig:
    return ClusterStoreConfig(ec=ECConfig(k=K, m=M))


def _engine_process(cluster, prompt_seed: int, prompt_len: int) -> dict:
    cmd = [sys.executable, str(HARNESS), "--nodes", json.dumps(cluster.addresses), "--k", str(K), "--m", str(M),
           "--prompt-seed", str(prompt_seed), "--prompt-len", str(prompt_len), "--max-tokens", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_one_store(cluster):
    first = _engine_process(cluster, prompt_seed=11, prompt_len=2000)
    assert first["num_cached_tokens"] == 0
    assert first["stats"]["num_written_store"] >= 1920 // h.BLOCK_SIZE
    assert first["stats"]["num_store_write_failures"] == 0

    second = _engine_process(cluster, prompt_seed=11, prompt_len=2000)
    assert second["num_cached_tokens"] >= 1900  # (2000 - 1) // 128 = 15 blocks = 1,920 tokens
    assert second["cached_tokens_by_tier"] == {TIER_DEVICE: 0, TIER_HOST: 0, TIER_STORE: second["num_cached_tokens"]}
    assert second["stats"]["num_loaded_store"] == second["num_cached_tokens"] // h.BLOCK_SIZE
    assert second["stats"]["num_deadline_misses"] == 0
    assert second["token_ids"] == first["token_ids"] and len(first["token_ids"]) == 8


def _run_in_process(cluster, prompt_seed: int, load_deadline_s: float, *, wait_writes: bool):
    num_blocks = 16
    runner = h.make_runner(num_blocks)
    offload = KVOffload.build(runner, store=ClusterStore(cluster.addresses, _store_config()),
                              config=KVOffloadConfig(load_deadline_s=load_deadline_s, write_deadline_s=5.0))
    try:
        core = h.make_core(runner, num_blocks, offload)
        out = h.generate(core, [("r", h.prompt(prompt_seed, 600), h.greedy(6))])["r"]
        if wait_writes:
            assert offload.wait_for_writes(30)
        return out, offload.stats
    finally:
        offload.close()


def _set_delay(cluster, delay_ms: float) -> None:
    async def send():
        async with ClusterStore(cluster.addresses, _store_config()) as s:
            await asyncio.gather(*(s.request_node(n, DebugSet(delay_ms=delay_ms)) for n in cluster.names))

    asyncio.run(send())


def test_slow_or_dead_store_falls_back_to_recompute(cluster):
    written, stats = _run_in_process(cluster, prompt_seed=21, load_deadline_s=2.0, wait_writes=True)
    assert written.num_cached_tokens == 0 and stats.num_written_store >= 4

    # every daemon answers 400 ms late: the 100 ms read deadline passes -> recompute, same tokens
    _set_delay(cluster, 400)
    try:
        slow, stats = _run_in_process(cluster, prompt_seed=21, load_deadline_s=0.1, wait_writes=False)
    finally:
        _set_delay(cluster, 0)
    assert stats.num_deadline_misses == 1 and stats.num_loaded_store == 0
    assert slow.num_cached_tokens == 0 and slow.metrics.cached_tokens_by_tier[TIER_STORE] == 0
    assert slow.outputs[0].token_ids == written.outputs[0].token_ids

    # healthy again: the same prompt is a store hit
    hit, stats = _run_in_process(cluster, prompt_seed=21, load_deadline_s=2.0, wait_writes=False)
    assert hit.metrics.cached_tokens_by_tier[TIER_STORE] == 4 * h.BLOCK_SIZE
    assert hit.outputs[0].token_ids == written.outputs[0].token_ids

    # every daemon SIGKILLed: reads find nobody, the request is computed, same tokens
    for name in cluster.names:
        cluster.kill(name)
    try:
        dead, stats = _run_in_process(cluster, prompt_seed=21, load_deadline_s=0.2, wait_writes=False)
    finally:
        for name in cluster.names:
            cluster.restart(name)
    assert stats.num_deadline_misses + stats.num_store_unavailable == 1 and stats.num_loaded_store == 0
    assert dead.num_cached_tokens == 0
    assert dead.outputs[0].token_ids == written.outputs[0].token_ids
