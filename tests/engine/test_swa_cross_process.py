"""SWA slots across processes: a conversation continued on a second engine fetches the slot from
the engine process that produced it (no replay, same tokens); with that process killed the
second engine falls back to bounded replay and still answers."""

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

pytest.importorskip("transformers")

from deepinfer.cache.swa_directory import SwaDirectoryService  # noqa: E402
from deepinfer.cache.swa_fetch import SwaSlotFetcher  # noqa: E402
from deepinfer.cache.swa_store import SlotLayout, SwaSlotStore  # noqa: E402
from deepinfer.transport.protocol import DownReason, PeerDown, Role  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import swa_owner_proc as owner_proc  # noqa: E402


def tokens(seed, n, vocab):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "swa_owner_proc.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def line(self, timeout_s: float = 240) -> dict:
        raw = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        assert raw, f"owner process exited with {self.proc.poll()}"
        return json.loads(raw)

    async def generate(self, prompt, max_tokens) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return await self.line()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


async def _until(pred, timeout_s=10.0):
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_slot_fetched_across_processes_then_owner_killed(tmp_path):
    child = Child()
    directory = SwaDirectoryService("tcp://127.0.0.1:*")
    fetcher = None
    try:
        addresses = await child.line()
        dir_address = await directory.start()
        directory.connect_owner(addresses["events"])
        ref = owner_proc.build_reference()
        vocab = ref.config.vocab_size
        layout_of = owner_proc.build_core(ref).runner  # the slot layout a core of this model has
        store = SwaSlotStore(SlotLayout(layout_of.swa.specs, carry_dtype=layout_of.dtype), 8)
        fetcher = await SwaSlotFetcher(store, node_name="second", directory_address=dir_address,
                                       receive_address=f"ipc://{tmp_path}/swa-recv").start()
        core = owner_proc.build_core(ref, swa=dict(mode="bounded", replay_tokens=16, store=store, fetcher=fetcher,
                                                   fetch_deadline_s=1.0))
        mgr = core.hooks.swa_slots

        async def turn_one(seed, n_prompt):
            p1 = tokens(seed, n_prompt, vocab)
            first = await child.generate(p1, 9)
            # the second engine computes the same blocks (as it would read them from the KV store)
            # but keeps no slot of its own: the slot exists only in the owner process
            assert owner_proc.generate(core, f"local{seed}", p1, 9) == first["tokens"]
            for key, _ in mgr.store.stored_boundaries():
                mgr.store.remove(key)
            return p1 + first["tokens"]

        # conversation A: turn 2 on the owner (local slot) and on the second engine (fetched slot)
        history = await turn_one(0, 58)  # 67 tokens: the slot at boundary 64
        p2 = history + tokens(1, 10, vocab)
        key = mgr.prefix_hashes(p2)[3]
        await _until(lambda: directory.directory.locate(key) is not None)
        on_owner = await child.generate(p2, 6)
        assert on_owner["num_restored"] == 1
        hit_blocks = len(core.scheduler.pool.lookup_prefix(mgr.prefix_hashes(p2)[: (len(p2) - 1) // 16]))
        assert hit_blocks == 4
        fetched = await mgr.prefetch(p2, hit_blocks)
        assert fetched is not None and fetched.is_hit and fetched.num_tokens == 64 and fetched.node_name == "owner"
        assert owner_proc.generate(core, "a2", p2, 6) == on_owner["tokens"]
        assert mgr.stats.num_restored == 1 and mgr.stats.num_replayed_tokens == 0

        # conversation B: the owner is killed before the second engine continues it
        history_b = await turn_one(5, 90)  # 99 tokens: the slot at boundary 96
        p2b = history_b + tokens(6, 7, vocab)
        key_b = mgr.prefix_hashes(p2b)[5]
        await _until(lambda: directory.directory.locate(key_b) is not None)
        child.kill()
        hit_b = len(core.scheduler.pool.lookup_prefix(mgr.prefix_hashes(p2b)[: (len(p2b) - 1) // 16]))
        missed = await mgr.prefetch(p2b, hit_b)
        assert missed is not None and not missed.is_hit and missed.reason == "deadline"
        answer = owner_proc.generate(core, "b2", p2b, 6)
        assert len(answer) == 6
        assert mgr.stats.num_replayed_bounded == 1 and mgr.stats.num_replayed_tokens == 16
        # once heartbeats declare the owner down, its slots leave the directory
        directory.directory.on_peer_event(PeerDown("owner", Role.PREFILL, directory.directory._nodes["owner"].instance_id,
                                                   DownReason.MISSED_BEATS))
        assert directory.directory.locate(key_b) is None
    finally:
        child.kill()
        if fetcher is not None:
            await fetcher.close()
        await directory.close()
