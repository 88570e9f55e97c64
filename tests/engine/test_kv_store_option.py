"""The erasure-coded storage cluster as an engine option (EngineOptions.kv_store_nodes / kv_store_ec):
an AsyncEngine started with it over real storage daemons serves a prompt evicted from its device
pool out of the cluster with the same tokens, shuts down leaving no socket, thread or task behind,
and keeps serving identical tokens by recomputation when every daemon is killed mid-run or was
never up (one warning in the logs, no hang). Also the option's validation errors."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import pytest

from deepinfer import envs
from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.options import EngineOptions, EngineOptionsError, kv_store_cluster

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_NODES, EC = 6, "4+2"
BLOCK = 128
TEST_CACHE_DIR = Path(tempfile.gettempdir()) / "deepinfer-tests"  # shared with the gateway tests
OUTAGE_LINE = "kv store unavailable"


@functools.cache
def _model_dir() -> str:
    from deepinfer.runtime.gateway.builtin_model import ensure_builtin_model

    return str(ensure_builtin_model(TEST_CACHE_DIR, show_progress=False)[0])


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(length)]


async def _start(nodes: str, **options) -> AsyncEngine:
    # 12 blocks of 128: two 1,000-token prompts after a third evict it from the device pool
    base = dict(device="cpu", num_blocks=12, max_num_seqs=2, max_model_len=1536, kv_store_nodes=nodes,
                kv_store_ec=EC, kv_load_deadline_s=5.0, num_threads=1)
    return await AsyncEngine.start(model=_model_dir(), **{**base, **options})


async def _generate(engine: AsyncEngine, ids: list[int], max_tokens: int = 4):
    tokens: list[int] = []
    last = None
    t0 = time.monotonic()
    ttft = None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate({"prompt_token_ids": ids}, params):
        ttft = ttft if ttft is not None else time.monotonic() - t0
        tokens += out.outputs[0].token_ids
        last = out
    return tokens, last, ttft


async def _wait_written(engine: AsyncEngine, num_blocks: int, timeout_s: float = 30.0) -> None:
    offload = engine.core.kv_offload
    deadline = time.monotonic() + timeout_s
    while offload.stats.num_written_store < num_blocks:
        assert time.monotonic() < deadline, f"write-behind stuck: {offload.stats}"
        await asyncio.sleep(0.05)


def _connections_to(ports: set[int]) -> int:
    """TCP connections of this process whose remote port is one of ``ports`` (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                remote_port = int(cols[2].rsplit(":", 1)[1], 16)
                if cols[9] in inodes and remote_port in ports:
                    count += 1
    return count


def _ports(cluster: LocalCluster) -> set[int]:
    return {int(a.rsplit(":", 1)[1]) for a in cluster.addresses.values()}


def _kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("kv-tiers-io", "kv-write-behind"))]


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path / "kv", NUM_NODES) as c:
        yield c


@pytest.mark.timeout(150)
async def test_prompt_evicted_from_the_device_comes_back_from_the_cluster(cluster):
    tasks_before = asyncio.all_tasks()
    engine = await _start(",".join(cluster.addresses.values()))
    try:
        deadline = time.monotonic() + 10  # zmq connects in the background
        while _connections_to(_ports(cluster)) < 2 * NUM_NODES and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # per storage node one request DEALER and its reachability probe (cache/store/reachability.py)
        assert _connections_to(_ports(cluster)) == 2 * NUM_NODES
        long_prompt = _prompt(1, 1000)  # (1000 - 1) // 128 = 7 full blocks can hit
        first, out, ttft_computed = await _generate(engine, long_prompt)
        assert out.num_cached_tokens == 0 and len(first) == 4
        await _wait_written(engine, 7)
        for seed in (2, 3):  # 2 x 8 blocks through a 12-block pool: every block of the first is evicted
            await _generate(engine, _prompt(seed, 1000), max_tokens=1)
        again, out, ttft_store = await _generate(engine, long_prompt)
        assert again == first
        assert out.num_cached_tokens == 7 * BLOCK
        assert out.metrics.cached_tokens_by_tier == {TIER_DEVICE: 0, TIER_HOST: 0, TIER_STORE: 7 * BLOCK}
        stats = engine.core.kv_offload.stats
        assert stats.num_loaded_store == 7 and stats.num_store_write_failures == 0
        assert stats.num_store_reads_skipped == 0 and not engine.core.kv_offload.store_health.is_out
        print(f"TTFT of a 1,000-token prompt: computed {ttft_computed * 1e3:.0f} ms, "
              f"from the cluster store {ttft_store * 1e3:.0f} ms")
    finally:
        await engine.shutdown()
    # nothing of the store is left: sockets closed, I/O and writer threads joined, no task of ours
    deadline = time.monotonic() + 5
    while _connections_to(_ports(cluster)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _connections_to(_ports(cluster)) == 0
    assert _kv_threads() == []
    assert asyncio.all_tasks() - tasks_before == {asyncio.current_task()} - tasks_before


@pytest.mark.timeout(150)
async def test_daemons_killed_mid_run_requests_recompute_same_tokens(cluster, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.engine.kv.store_health")
    prompts = [_prompt(10 + i, 600) for i in range(3)]  # 4 full blocks each
    engine = await _start(",".join(cluster.addresses.values()), kv_load_deadline_s=1.0)
    try:
        want = [(await _generate(engine, ids))[0] for ids in prompts]
        await _wait_written(engine, 3 * 4)
        for seed in (20, 21):  # push every prompt out of the device pool
            await _generate(engine, _prompt(seed, 1000), max_tokens=1)
        runs = [asyncio.ensure_future(_generate(engine, ids, max_tokens=4)) for ids in prompts]
        await asyncio.sleep(0)  # the first is queued: its store read starts on the next step
        for name in cluster.names:
            cluster.kill(name)
        t0 = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*runs), 60)
        seconds = time.monotonic() - t0
        assert [tokens for tokens, _, _ in got] == want
        # the first read may have been answered before the kill; the others could not be
        stats = engine.core.kv_offload.stats
        assert sum(out.metrics.cached_tokens_by_tier.get(TIER_STORE, 0) == 0 for _, out, _ in got) >= 2, stats
        assert stats.num_deadline_misses + stats.num_store_unavailable + stats.num_store_reads_skipped >= 2, stats
        assert seconds < 30, f"requests took {seconds:.1f} s after the kill"
        # still dead: a prompt evicted again is recomputed again (its read skipped or failed, no new warning)
        for seed in (22, 23):
            await _generate(engine, _prompt(seed, 1000), max_tokens=1)
        again, out, _ = await _generate(engine, prompts[1])
        assert again == want[1] and out.num_cached_tokens == 0
        assert engine.core.kv_offload.store_health.is_out and stats.num_loaded_store <= 4
    finally:
        t0 = time.monotonic()
        await engine.shutdown()
        shutdown_s = time.monotonic() - t0
    assert shutdown_s < 15, f"shutdown took {shutdown_s:.1f} s with a dead cluster"
    assert _kv_threads() == []
    outage = [r for r in caplog.records if OUTAGE_LINE in r.getMessage()]
    assert len(outage) == 1 and outage[0].levelno == logging.WARNING, [r.getMessage() for r in outage]


def _free_addresses(n: int) -> list[str]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(90)
async def test_cluster_never_up_engine_serves_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.engine.kv.store_health")
    engine = await _start(",".join(_free_addresses(NUM_NODES)), kv_load_deadline_s=0.5)
    try:
        offload = engine.core.kv_offload
        for _ in range(200):  # the start-up probe (2 s) finds no node answering
            if offload.store_health.is_out:
                break
            await asyncio.sleep(0.05)
        assert offload.store_health.is_out
        t0 = time.monotonic()
        first, out, _ = await _generate(engine, _prompt(30, 600))
        for seed in (31, 32):  # evict it; then ask again: no store, so recomputed
            await _generate(engine, _prompt(seed, 1000), max_tokens=1)
        again, out2, _ = await _generate(engine, _prompt(30, 600))
        assert again == first and len(first) == 4 and out2.num_cached_tokens == 0
        assert time.monotonic() - t0 < 45
        assert offload.stats.num_loaded_store == 0 and offload.stats.num_written_store == 0
        assert offload.stats.num_store_reads_skipped >= 1
    finally:
        t0 = time.monotonic()
        await engine.shutdown()
        assert time.monotonic() - t0 < 15
    # every copied-out block either went nowhere on purpose or is counted as not written
    stats = offload.stats
    assert stats.num_copied_out > 0
    assert stats.num_store_writes_dropped + stats.num_store_write_failures == stats.num_copied_out, stats
    outage = [r for r in caplog.records if OUTAGE_LINE in r.getMessage()]
    assert len(outage) == 1 and "did not answer" in outage[0].getMessage(), [r.getMessage() for r in outage]
    assert "tcp://127.0.0.1:" in outage[0].getMessage()  # it names the nodes


@pytest.mark.parametrize("options, message", [
    (dict(kv_store_nodes="tcp://127.0.0.1:1", kv_store_dir="/tmp/kv"), "not both"),
    (dict(kv_store_nodes="tcp://127.0.0.1:1,tcp://127.0.0.1:2"), "erasure coding 10+2 needs at least 12"),
    (dict(kv_store_nodes="tcp://127.0.0.1:1,127.0.0.1:2", kv_store_ec="1+1"), "'127.0.0.1:2' is not a storage node"),
    (dict(kv_store_nodes="tcp://127.0.0.1:1,tcp://127.0.0.1:1", kv_store_ec="1+1"), "listed twice"),
    (dict(kv_store_nodes="tcp://127.0.0.1:1", kv_store_ec="one"), "kv_store_ec must be K+M"),
    (dict(kv_store_nodes="tcp://127.0.0.1:1", kv_store_ec="0+1"), "kv_store_ec must be K+M"),
    (dict(kv_store_nodes="/nonexistent/cluster.toml"), "neither storage node addresses"),
    (dict(kv_store_nodes=""), "kv_store_nodes is empty"),
    (dict(kv_store_nodes=7), "kv_store_nodes must be addresses"),
])
def test_bad_store_cluster_options_one_line(options, message):
    with pytest.raises(EngineOptionsError) as info:
        EngineOptions(**options)
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_environment_names_the_cluster_unless_an_option_does(monkeypatch):
    snapshot = envs.load({"DEEPINFER_KV_STORE_NODES": "tcp://h1:1,tcp://h2:1,tcp://h3:1",
                          "DEEPINFER_KV_STORE_EC": "2+1"})
    monkeypatch.setattr(envs, "_snapshot", snapshot)
    cluster = kv_store_cluster(EngineOptions())
    assert len(cluster.node2address) == 3 and (cluster.ec_k, cluster.ec_m) == (2, 1)
    assert kv_store_cluster(EngineOptions(kv_store_nodes="tcp://x:1", kv_store_ec="1+0")).node2address == {
        "tcp://x:1": "tcp://x:1"}
    with pytest.raises(EngineOptionsError, match="DEEPINFER_KV_STORE_NODES and kv_store_dir"):
        kv_store_cluster(EngineOptions(kv_store_dir="/tmp/kv"))
    monkeypatch.setattr(envs, "_snapshot", envs.load({}))
    assert kv_store_cluster(EngineOptions()) is None
