"""SWA slots through the user-facing path: ``AsyncEngine.start(..., swa_* options)``.

- a finished conversation continued on the same engine restores the local slot (no replay);
- exact replay (no store) gives the tokens of an engine without prefix caching;
- continued on a second engine *process* (its prefix blocks from a shared KV store, the slot
  from the first process via the SWA directory) it restores the fetched slot and gives the
  first process's tokens; with the owner process killed it falls back to bounded replay.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cache.swa_directory import SwaDirectoryService
from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.options import EngineOptionsError
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.transport.protocol import DownReason, PeerDown, Role

HERE = Path(__file__).resolve().parent
BS = 16  # no HCA layer in the model below: blocks of 16 tokens
BASE = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=4, block_size=BS, num_threads=1,
            check_integrity_every_step=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_swa")
    write_tiny_model(path, seed=3, layers="WCWC")  # window 128: exact replay = 4 x 128 tokens
    return path


def tokens(seed: int, n: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


async def generate(engine: AsyncEngine, prompt: list[int], max_tokens: int, rid: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: list[int] = []
    async for delta in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        out += delta.outputs[0].token_ids
    return out


@pytest.mark.timeout(240)
async def test_continuation_restores_local_slot_and_exact_replay_equals_no_cache(model_dir):
    p1 = tokens(0, 58)
    engine = await AsyncEngine.start(model=str(model_dir), swa_replay="bounded", swa_replay_tokens=16,
                                     swa_store_slots=8, **BASE)
    try:
        stats = engine.swa_slots.stats
        o1 = await generate(engine, p1, 9, "t1")  # 67 tokens: the slot at boundary 64 is saved
        assert stats.num_saved == 1 and engine.swa_slots.store.stored_boundaries()[0][1] == 64
        p2 = p1 + o1 + tokens(1, 10)
        restored = await generate(engine, p2, 6, "t2")
        assert stats.num_restored == 1 and stats.num_replayed_tokens == 0
        assert stats.num_replayed_bounded == stats.num_replayed_exact == 0
    finally:
        await engine.shutdown()

    # exact replay without a store (hit 64 < 512: the whole hit is replayed): a no-cache engine's tokens
    exact = await AsyncEngine.start(model=str(model_dir), swa_replay="exact", swa_store_slots=0, **BASE)
    nocache = await AsyncEngine.start(model=str(model_dir), enable_prefix_caching=False, **BASE)
    try:
        assert await generate(exact, p1, 9, "t1") == o1
        want = await generate(nocache, p2, 6, "t2")
        got = await generate(exact, p2, 6, "t2")
        assert exact.swa_slots is None  # exact replay, no store: the scheduler's own rebuild
        assert exact.core.scheduler.pool.num_hits > 0  # it did hit the prefix cache
        assert got == want
        # the MXFP8 slot restore answered like the exact rebuild on this model
        assert restored == want
    finally:
        await exact.shutdown()
        await nocache.shutdown()


@pytest.mark.timeout(240)
async def test_snapshot_prompts_saves_the_slot_of_a_prompt_that_ends_mid_block(model_dir):
    p1 = tokens(2, 75)  # ends 11 past boundary 64 (> lookahead 6); one output token crosses nothing
    p2 = None
    results = {}
    for snapshot in (False, True):
        engine = await AsyncEngine.start(model=str(model_dir), swa_replay="bounded", swa_replay_tokens=16,
                                         swa_store_slots=4, swa_snapshot_prompts=snapshot, **BASE)
        try:
            o1 = await generate(engine, p1, 1, "t1")
            p2 = p2 or p1 + o1 + tokens(3, 8)
            results[snapshot] = await generate(engine, p2, 4, "t2")
            stats = engine.swa_slots.stats
            if snapshot:  # the prompt ran as [0, 64) + [64, 75): the state at 64 became a slot
                assert stats.num_saved >= 1 and stats.num_restored == 1 and stats.num_replayed_tokens == 0
            else:  # no slot at 64: the hit replays (bounded, 16 tokens)
                assert stats.num_restored == 0 and stats.num_replayed_bounded == 1 and stats.num_replayed_tokens == 16
        finally:
            await engine.shutdown()
    assert len(results[True]) == len(results[False]) == 4


async def test_swa_options_reach_the_engine_and_bad_ones_are_one_line(model_dir):
    engine = await AsyncEngine.start(model=str(model_dir), swa_replay="bounded", swa_replay_tokens=32,
                                     swa_store_slots=None, **BASE)
    try:
        sched = engine.core.scheduler
        assert sched.config.max_replay_tokens == 32
        assert engine.swa_slots.store.num_slots == 4 * BASE["max_num_seqs"]  # None: 4 x max_num_seqs
        assert engine.swa_peer is None and engine.swa_slots.fetcher is None
    finally:
        await engine.shutdown()
    for bad, message in [(dict(swa_replay="approx"), "swa_replay must be 'exact' or 'bounded'"),
                         (dict(swa_replay_tokens=0), "swa_replay_tokens must be an integer >= 1"),
                         (dict(swa_store_slots=-2), "swa_store_slots must be an integer >= 0"),
                         (dict(swa_directory="localhost:5"), "swa_directory must be tcp://HOST:PORT"),
                         (dict(swa_directory="tcp://127.0.0.1:5", swa_store_slots=0),
                          "swa_directory needs a slot store"),
                         (dict(kv_load_deadline_s=-1.0), "kv_load_deadline_s must be a number of seconds > 0")]:
        with pytest.raises(EngineOptionsError, match=message) as info:
            await AsyncEngine.start(model=str(model_dir), **bad, **BASE)
        assert len(str(info.value).splitlines()) == 1


class PeerProcess:
    """An AsyncEngine process (tests/engine/swa_async_peer_proc.py) that owns its slots."""

    def __init__(self, model_dir: Path, options: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "swa_async_peer_proc.py"), str(model_dir),
                                      json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def line(self, timeout_s: float = 180) -> dict:
        raw = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        assert raw, f"peer process exited with {self.proc.poll()}"
        return json.loads(raw)

    async def generate(self, prompt: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return await self.line()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


async def _until(pred, timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_second_engine_process_fetches_the_slot_then_replays_when_the_owner_is_dead(model_dir, tmp_path):
    directory = SwaDirectoryService("tcp://127.0.0.1:*")
    dir_address = await directory.start()
    # both engines share one KV store directory (the prefix blocks) and the SWA directory (the slots)
    shared = dict(BASE, swa_replay="bounded", swa_replay_tokens=16, swa_store_slots=8, swa_directory=dir_address,
                  kv_store_dir=str(tmp_path / "kv"), kv_load_deadline_s=5.0)
    owner = PeerProcess(model_dir, dict(shared, swa_node_name="owner"))
    second = None
    try:
        assert (await owner.line())["ready"] == "owner"
        second = await AsyncEngine.start(model=str(model_dir), swa_node_name="second", swa_fetch_deadline_s=2.0,
                                         **{k: v for k, v in shared.items() if k != "swa_fetch_deadline_s"})
        mgr = second.swa_slots

        # conversation A: turn 2 on the owner (its local slot) and on the second engine (fetched)
        p1 = tokens(0, 58)
        first = await owner.generate(p1, 9)
        p2 = p1 + first["tokens"] + tokens(1, 10)
        await _until(lambda: directory.directory.locate(mgr.prefix_hashes(p2)[3]) is not None)
        on_owner = await owner.generate(p2, 6)
        assert on_owner["num_restored"] == 1
        got = await generate(second, p2, 6, "a2")
        assert got == on_owner["tokens"]
        assert mgr.stats.num_fetched == 1 and mgr.stats.num_restored == 1
        assert mgr.stats.num_replayed_tokens == 0 and mgr.stats.num_replayed_bounded == 0
        assert second.core.kv_offload.stats.num_loaded_store >= 4  # the prefix blocks came from the KV store

        # conversation B: the owner is killed before the second engine continues it
        q1 = tokens(5, 90)
        first_b = await owner.generate(q1, 9)  # 99 tokens: the slot at boundary 96
        q2 = q1 + first_b["tokens"] + tokens(6, 7)
        key_b = mgr.prefix_hashes(q2)[5]
        await _until(lambda: directory.directory.locate(key_b) is not None)
        owner.kill()
        continued = asyncio.ensure_future(generate(second, q2, 6, "b2"))
        # the fetch from the dead owner waits for its deadline inside submit: other requests run meanwhile
        other = await asyncio.wait_for(generate(second, tokens(9, 20), 2, "other"), 30)
        assert len(other) == 2 and not continued.done()
        answer = await asyncio.wait_for(continued, 60)
        assert len(answer) == 6
        assert mgr.stats.num_fetch_failures == 1 and mgr.stats.num_restored == 1
        assert mgr.stats.num_replayed_bounded == 1 and mgr.stats.num_replayed_tokens == 16
        # once heartbeats declare the owner down, its slots leave the directory
        node = directory.directory._nodes["owner"]
        directory.directory.on_peer_event(PeerDown("owner", Role.PREFILL, node.instance_id, DownReason.MISSED_BEATS))
        assert directory.directory.locate(key_b) is None
    finally:
        owner.kill()
        if second is not None:
            await second.shutdown()
        await directory.close()
