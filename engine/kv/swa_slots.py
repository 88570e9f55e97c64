"""The engine side of SWA slots: snapshot, save, restore, prefetch (policy in swa_replay.py).

``SwaSlotManager`` is one of an EngineCore's parts (``build_swa_slots`` -> ``EngineHooks``):

- scheduler hooks (engine thread): ``has_slot`` / ``on_admit`` decide restore vs replay at
  admission; ``on_release`` (finish or preempt, before blocks are freed) commits the sequence's
  latest boundary snapshot to the store under that boundary's prefix hash; ``may_cache_blocks``
  keeps blocks computed over a bounded-replay (approximate) state out of the prefix cache.
- runner wrapper (device thread, ``SwaSlotRunner``): before a forward it writes restored slots
  into the sequences' SWA slots; after it, it snapshots every sequence whose forward ended at
  (or up to ``lookahead`` past) a block boundary into the store's staging row.
- ``prefetch`` (asyncio, before a request is queued): when the local store lacks the slot at the
  request's prefix-hit boundary, fetch it from the node the directory names, within a deadline;
  a miss leaves the request to replay.

Restores are queued per seq id at admission and consumed by the first forward that carries
that sequence: execution is serial, so the write lands after any in-flight step that used the
same SWA slot for an earlier (finished) sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deepinfer.cache.block_hash import BlockHash, extend_block_hashes, root_hash
from deepinfer.cache.swa_fetch import FetchResult, SwaSlotFetcher
from deepinfer.cache.swa_store import SlotLayout, SwaSlotStore
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.request import Request
from deepinfer.engine.kv.swa_replay import (
    DEFAULT_REPLAY_TOKENS,
    SwaReplayMode,
    exact_replay_tokens,
    is_approximate,
    max_replay_tokens,
    snapshot_boundary,
    snapshot_chunk_end,
)
from deepinfer.engine.sched.types import SchedulerConfig


@dataclass(slots=True)
class SwaSlotStats:
    num_restored: int = 0  # admissions that restored a slot (no replay)
    num_replayed_exact: int = 0  # admissions with a hit that replayed exactly
    num_replayed_bounded: int = 0  # admissions with a hit that replayed approximately
    num_replayed_tokens: int = 0
    num_snapshots: int = 0
    num_saved: int = 0  # snapshots committed as stored slots
    num_fetched: int = 0  # slots fetched from another engine
    num_fetch_misses: int = 0  # prefetches no engine held a slot for
    num_fetch_failures: int = 0  # a listed slot not fetched (dead owner, deadline, evicted): replayed


class SwaSlotManager:
    def __init__(self, store: SwaSlotStore, *, block_size: int, lookahead: int, num_exact_tokens: int,
                 model_id: str, dtype: torch.dtype, fetcher: SwaSlotFetcher | None = None,
                 fetch_deadline_s: float = 1.0) -> None:
        self.store = store
        self.block_size = block_size
        self.lookahead = lookahead
        self.num_exact_tokens = num_exact_tokens
        self.model_id = model_id
        self.dtype = dtype
        self.fetcher = fetcher
        self.fetch_deadline_s = fetch_deadline_s
        # end prompt chunks at their last block boundary so a slot is saved there (costs the
        # prompt's tail one more step); set by build_swa_slots when a store is built
        self.snapshot_prompts = False
        self.stats = SwaSlotStats()
        # seq id -> decoded slot, read when the scheduler asks (so a later LRU eviction cannot
        # take it away), moved to _restores at admission, consumed by the sequence's first forward
        self._pending: dict[int, tuple[BlockHash, dict[str, torch.Tensor]]] = {}
        self._restores: dict[int, dict[str, torch.Tensor]] = {}
        self._live: set[int] = set()  # admitted seq ids whose slot state may be snapshotted
        self._approximate: set[int] = set()
        self._lock = threading.Lock()  # staging (device thread) vs commit/discard (engine thread)

    # ---- scheduler hooks (engine thread) ------------------------------------------------------
    def boundary_key(self, req: Request, boundary: int) -> BlockHash | None:
        i = boundary // self.block_size - 1
        return req.block_hashes[i] if 0 <= i < len(req.block_hashes) else None

    def has_slot(self, req: Request, hit_len: int) -> bool:
        key = self.boundary_key(req, hit_len) if hit_len > 0 else None
        if key is None:
            return False
        pending = self._pending.get(req.seq_id)
        if pending is not None and pending[0] == key:
            return True
        if self.store.boundary_of(key) != hit_len:
            return False
        got = self.store.read(key, self.dtype)
        if got is None or got[0] != hit_len:
            return False
        self._pending[req.seq_id] = (key, got[1])
        return True

    def on_admit(self, req: Request, hit_len: int, *, is_restored: bool) -> None:
        """After the scheduler admitted ``req`` (slot assigned, window_start/write_from set)."""
        with self._lock:
            self._live.add(req.seq_id)
            pending = self._pending.pop(req.seq_id, None)
            if is_restored:
                assert pending is not None, f"sequence {req.seq_id} admitted for a restore that has_slot never found"
                self._restores[req.seq_id] = pending[1]
                self.stats.num_restored += 1
                return
            num_replay = hit_len - req.window_start
            if hit_len:
                self.stats.num_replayed_tokens += num_replay
            if is_approximate(req.window_start, hit_len, self.num_exact_tokens):
                self._approximate.add(req.seq_id)
                self.stats.num_replayed_bounded += 1
            elif hit_len:
                self.stats.num_replayed_exact += 1

    def chunk_tokens(self, req: Request, start: int, num_tokens: int, *, hit_len: int | None = None) -> int:
        """Scheduler hook: the chunk ``[start, start + num_tokens)`` of ``req``, shortened to end at
        its known tokens' last block boundary when that lets the state there be snapshotted
        (``snapshot_prompts``). ``hit_len``: at admission (the replay plan is not noted yet)."""
        if not self.snapshot_prompts or req.seq_id in self._approximate:
            return num_tokens
        if hit_len is not None and is_approximate(start, hit_len, self.num_exact_tokens):
            return num_tokens
        end = snapshot_chunk_end(start, start + num_tokens, req.num_tokens, self.block_size, self.lookahead)
        return end - start

    def may_cache_blocks(self, req: Request) -> bool:
        return req.seq_id not in self._approximate

    def on_release(self, req: Request) -> None:
        """Finish or preempt, before the blocks are freed: save the latest boundary snapshot when
        its blocks are in the prefix cache (else nobody could hit it), else drop it."""
        with self._lock:
            self._live.discard(req.seq_id)
            self._approximate.discard(req.seq_id)
            self._restores.pop(req.seq_id, None)
            self._pending.pop(req.seq_id, None)
            boundary = self.store.staged_boundary(req.seq_id)
            key = self.boundary_key(req, boundary) if boundary else None
            if key is not None and boundary // self.block_size <= req.num_registered_blocks:
                if self.store.commit(req.seq_id, key):
                    self.stats.num_saved += 1
            else:
                self.store.discard(req.seq_id)

    # ---- runner side (device thread) ---------------------------------------------------------
    def before_forward(self, batch: ForwardBatch, runner) -> None:
        if not self._restores:
            return
        for step in batch.steps:
            rings = self._restores.pop(step.seq_id, None)
            if rings is not None:
                runner.swa.write_slot(step.slot, rings)  # copies host -> device

    def after_forward(self, batch: ForwardBatch, runner) -> None:
        for step in batch.steps:
            if step.seq_id in self._approximate or step.seq_id not in self._live:
                continue
            num_known = step.end_pos - max(0, step.num_logits - 1)  # drafts of a verify step are above it
            boundary = snapshot_boundary(step.end_pos, num_known, self.block_size, self.lookahead)
            if boundary is None or boundary <= step.start_pos - self.lookahead:
                continue
            with self._lock:
                if step.seq_id not in self._live or self.store.staged_boundary(step.seq_id) == boundary:
                    continue
                if self.store.stage(step.seq_id, boundary, runner.swa.read_slot(step.slot)):
                    self.stats.num_snapshots += 1

    # ---- prefetch (asyncio) ------------------------------------------------------------------
    def prefix_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str = "") -> list[BlockHash]:
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, prompt_token_ids, self.block_size, root_hash(self.model_id, cache_salt))
        return hashes

    def known_hit_blocks(self, kv, prompt_token_ids: Sequence[int],
                         cache_salt: str = "") -> tuple[list[BlockHash], int, int]:
        """(lookup hashes, blocks a prefix lookup will hit for sure, blocks it may hit at most)
        as the scheduler's ``KVManager`` ``kv`` sees the prompt now: the device pool and the host
        tier are known; blocks past them may still come from the KV store (engine/kv/offload.py)."""
        n = (len(prompt_token_ids) - 1) // self.block_size  # as KVManager: one token is always computed
        if n <= 0:
            return [], 0, 0
        hashes = self.prefix_hashes(prompt_token_ids[: n * self.block_size], cache_salt)
        num_known = kv.pool.cached_prefix_length(hashes)
        offload = kv.offload
        if offload is None:
            return hashes, num_known, num_known
        num_known += offload.tiers.host_run(hashes[num_known:])
        return hashes, num_known, n if offload.tiers.has_store else num_known

    async def prefetch(self, prompt_token_ids: Sequence[int], hit_blocks: int, cache_salt: str = "", *,
                       max_hit_blocks: int | None = None,
                       hashes: Sequence[BlockHash] | None = None) -> FetchResult | None:
        """Fetch the slot at the prefix hit unless the store has it; None when there is nothing
        to do (no hit, slot already local, no fetcher).

        The hit is ``hit_blocks`` blocks, or any length up to ``max_hit_blocks`` when part of
        it is still unknown (KV store reads): then the longest boundary another node holds
        between the two is fetched, unless this store holds a slot at a longer one."""
        top = max(hit_blocks, max_hit_blocks or 0)
        if self.fetcher is None or top <= 0:
            return None
        if hashes is None:
            hashes = self.prefix_hashes(prompt_token_ids[: top * self.block_size], cache_salt)
        keys: list[BlockHash] = []
        for i in range(top, max(hit_blocks, 1) - 1, -1):  # longest boundary first
            key = hashes[i - 1]
            if self.store.boundary_of(key) == i * self.block_size:
                break  # held here: a shorter one could only be worse
            keys.append(key)
        if not keys:
            return None
        result = await self.fetcher.fetch(keys, self.fetch_deadline_s)
        if result.is_hit:
            self.stats.num_fetched += 1
        elif result.reason == "none":
            self.stats.num_fetch_misses += 1
        else:
            self.stats.num_fetch_failures += 1
        return result

    async def prefetch_for(self, kv, prompt_token_ids: Sequence[int], cache_salt: str = "") -> FetchResult | None:
        """``prefetch`` for the hit a request queued now would get (``known_hit_blocks``)."""
        if self.fetcher is None:
            return None
        hashes, num_known, num_max = self.known_hit_blocks(kv, prompt_token_ids, cache_salt)
        return await self.prefetch(prompt_token_ids, num_known, cache_salt, max_hit_blocks=num_max, hashes=hashes)


class SwaSlotRunner:
    """Wraps the runner EngineCore calls: restores before and snapshots after each forward."""

    def __init__(self, runner, manager: SwaSlotManager) -> None:
        self.runner = runner
        self.manager = manager

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        self.manager.before_forward(batch, self.runner)
        logits = self.runner.execute(batch)
        self.manager.after_forward(batch, self.runner)
        return logits


@dataclass(slots=True)
class SwaSlotParts:
    """What ``build_swa_slots`` gives an EngineCore at construction."""

    manager: SwaSlotManager  # EngineHooks(swa_slots=...)
    runner: object  # the runner to build the core with (wrapped when slots are stored)
    scheduler: SchedulerConfig  # the scheduler config with the replay mode's max_replay_tokens


def build_swa_slots(runner, scheduler: SchedulerConfig, *, mode: SwaReplayMode = "bounded",
                    replay_tokens: int = DEFAULT_REPLAY_TOKENS, store: SwaSlotStore | None = None,
                    num_store_slots: int = 64, fetcher: SwaSlotFetcher | None = None, fetch_deadline_s: float = 1.0,
                    is_window_mxfp8: bool = True, snapshot_prompts: bool = False) -> SwaSlotParts:
    """The SWA slot parts of an engine with ``swa_replay`` = ``mode`` and (with a store) slot
    save/restore, for ``EngineCore(parts.runner, config(parts.scheduler), hooks=EngineHooks(swa_slots=parts.manager))``.

    ``store=None`` builds a host store of ``num_store_slots`` slots in the runner's layout;
    ``num_store_slots=0`` sets only the replay mode and gives a manager without a store (the runner
    stays unwrapped). ``snapshot_prompts``: end every prompt's last chunk at its last block
    boundary, so its slot is saved even when the sequence stops before decoding past a boundary
    (a P/D prefill)."""
    cfg = runner.config
    max_replay = max_replay_tokens(mode, sliding_window=cfg.sliding_window, num_layers=cfg.num_hidden_layers,
                                   replay_tokens=replay_tokens)
    if mode == "bounded" and hasattr(runner, "bounded_replay"):  # a model that bounds some layers itself
        max_replay = runner.bounded_replay(replay_tokens)
    scheduler = replace(scheduler, max_replay_tokens=max_replay)
    if store is None:
        layout = SlotLayout(runner.swa.specs, carry_dtype=runner.dtype, is_window_mxfp8=is_window_mxfp8)
        store = SwaSlotStore(layout, max(num_store_slots, 1))
    manager = SwaSlotManager(store, block_size=scheduler.block_size, lookahead=runner.geometry.lookahead,
                             num_exact_tokens=exact_replay_tokens(cfg.sliding_window, cfg.num_hidden_layers),
                             model_id=scheduler.model_id, dtype=runner.dtype, fetcher=fetcher,
                             fetch_deadline_s=fetch_deadline_s)
    if num_store_slots:
        runner = SwaSlotRunner(runner, manager)
        manager.snapshot_prompts = snapshot_prompts and scheduler.enable_prefix_caching
    return SwaSlotParts(manager, runner, scheduler)
