"""Engine side of the KV tiers: prefix blocks loaded from host memory / the store, new blocks
written behind. Built once per engine, given with ``EngineCore(..., hooks=EngineHooks(kv_offload=...))``.

Who runs what (no step ever waits for the network):

    engine thread (scheduler, via KVManager)        I/O thread (own asyncio loop)    device thread
    ---------------------------------------------   ------------------------------   -------------
    is_ready(req): walk device -> host -> store;    KVTiers.read_store(deadline)     plan.device_io:
      blocks past the host tier -> start a store    KVTiers.write_store(batch)        1. read_blocks
      read; False (the request waits, others                                            registered
      run) until it is done or its deadline passed  writer thread:                      since the last
    extend_hits(req): host / fetched blocks ->        pack -> host tier -> store        plan (write-
      fresh device blocks, registered in the pool                                       behind)
      now; their rows are written by the device                                       2. write_blocks
      thread before the next forward (device_io)                                        promoted rows
    on_registered(blocks): queue a copy-out                                           then the forward

Why device_io runs on the device thread, first thing in the next plan's job: the runner's KV API
must not run concurrently with a forward, a freshly allocated block may still be written by the
step in flight (its old owner was preempted in this very schedule), and a block registered at
commit N cannot be reused before a plan scheduled after that commit, so reading it before that
plan's forward sees exactly the rows step N wrote.

The SWA state at the hit boundary is rebuilt by the scheduler's bounded exact replay
(SchedulerConfig.max_replay_tokens): promoted blocks are ordinary prefix hits to it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.kv_block_codec import BlockCodec, BlockCodecError
from deepinfer.cache.kv_tiers import TIER_DEVICE, TIER_HOST, TIER_STORE, KVTiers, StoreRead
from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.engine.core.request import Request
from deepinfer.engine.kv.store_health import StoreHealth
from deepinfer.engine.kv.write_behind import WriteBehind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVOffloadConfig:
    load_deadline_s: float = 0.25  # a store read not done by then: recompute from there
    write_deadline_s: float = 10.0
    traffic_class: str = "chat"  # the store's TTL class of written blocks
    max_store_blocks_per_read: int = 4096
    max_store_writes_in_flight: int = 64  # batches; past this, write-behind drops (counted)
    write_to_host: bool = True
    write_to_store: bool = True

    def __post_init__(self) -> None:
        if self.load_deadline_s <= 0 or self.write_deadline_s <= 0:
            raise ValueError("kv offload deadlines must be > 0 seconds")


@dataclass(slots=True)
class KVOffloadStats:
    num_store_reads: int = 0  # requests that asked the store
    num_store_blocks_asked: int = 0
    num_store_blocks_hit: int = 0
    num_deadline_misses: int = 0  # store reads that missed their deadline (the rest recomputed)
    num_store_unavailable: int = 0
    num_store_reads_skipped: int = 0  # lookups that did not ask the store: it failed recently (kv_store_health.py)
    num_bad_payloads: int = 0  # blocks whose bytes did not fit the layout (treated as misses)
    num_loaded_host: int = 0  # blocks written into the device from the host tier
    num_loaded_store: int = 0  # ... from the store
    num_copied_out: int = 0  # blocks read from the device for write-behind
    num_written_store: int = 0
    num_store_write_failures: int = 0
    num_store_writes_dropped: int = 0  # blocks not written: too many batches in flight, or the store is out


@dataclass(slots=True)
class _Load:
    """One waiting request's tier lookup."""

    future: Future[StoreRead] | None = None
    hashes: list[BlockHash] = field(default_factory=list)  # asked from the store
    give_up_at: float = 0.0
    staged: dict[BlockHash, bytes] = field(default_factory=dict)  # store hits, until promoted
    promoted: dict[BlockHash, str] = field(default_factory=dict)  # hash -> tier it came from
    is_done: bool = False


class KVOffload:
    def __init__(self, tiers: KVTiers, runner, config: KVOffloadConfig = KVOffloadConfig()):
        """``runner``: the ModelRunner KV API (``kv_layout``, ``read_blocks``, ``write_blocks``)."""
        self.tiers = tiers
        self.runner = runner
        self.config = config
        self.codec = BlockCodec.from_kv_layout(runner.kv_layout())
        if tiers.layout_fingerprint != self.codec.fingerprint:
            raise ValueError("KVTiers.layout_fingerprint must be the runner's block layout fingerprint "
                             "(build both with KVOffload.build)")
        self.block_size = runner.kv_layout().block_size
        self.stats = KVOffloadStats()
        self._loads: dict[str, _Load] = {}
        self._num_pending_loads = 0
        self._load_done = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._io_thread = threading.Thread(target=self._loop.run_forever, name="kv-tiers-io", daemon=True)
        self._io_thread.start()
        self._closed = False
        self.store_health = StoreHealth()
        self.writes = WriteBehind(tiers, runner, self.codec, config, self.stats, self.store_health, self._run_io)
        self._probe: Future | None = None
        store_start = getattr(tiers.store, "start", None)
        if store_start is not None:  # e.g. ClusterStore: its sockets live on the I/O loop
            try:
                self._run_io(store_start()).result(timeout=30)
            except BaseException:
                self.close()
                raise
        if hasattr(tiers.store, "node_stats"):  # a cluster: say at once which nodes do not answer
            self._probe = self._run_io(self._probe_cluster())

    async def _probe_cluster(self) -> None:
        from deepinfer.cache.store.probe import probe_cluster

        try:
            self.store_health.on_probe(await probe_cluster(self.tiers.store))
        except Exception as exc:  # noqa: BLE001 - a probe is advice; reads and writes judge the store anyway
            log.debug("kv store probe failed: %s", exc)

    @classmethod
    def build(cls, runner, *, host_capacity_bytes: int = 0, store=None,
              config: KVOffloadConfig = KVOffloadConfig()) -> "KVOffload":
        """Tiers for ``runner``'s layout: a host tier of ``host_capacity_bytes`` (0: none) and
        ``store`` (an ObjectStore, not yet started: it is started and closed on the I/O loop)."""
        from deepinfer.cache.host_tier import HostTier

        codec = BlockCodec.from_kv_layout(runner.kv_layout())
        host = HostTier(host_capacity_bytes) if host_capacity_bytes > 0 else None
        return cls(KVTiers(host, store, layout_fingerprint=codec.fingerprint), runner, config)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # reads and writes still running are abandoned (call wait_for_writes first to keep them)
        pending = self.writes.close()
        pending += [load.future for load in self._loads.values() if load.future is not None]
        if self._probe is not None:
            pending.append(self._probe)
        for fut in pending:
            fut.cancel()
        close = getattr(self.tiers.store, "close", None)
        if close is not None:
            try:
                self._run_io(close()).result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - shutting down; report, do not mask the caller's error
                log.warning("kv store close failed: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._io_thread.join(timeout=10)
        self._loop.close()

    def _run_io(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ---- scheduler side: admission (engine thread) ---------------------------------------
    def is_ready(self, req: Request, pool: BlockPool, hashes: Sequence[BlockHash]) -> bool:
        """False while blocks of ``hashes`` past the device and host tiers are being read from
        the store for ``req`` (the first call starts that read)."""
        load = self._loads.get(req.request_id)
        if load is None:
            load = self._loads[req.request_id] = _Load()
            num_device = pool.cached_prefix_length(hashes)
            num_host = self.tiers.host_run(hashes[num_device:])
            rest = hashes[num_device + num_host :][: self.config.max_store_blocks_per_read]
            if not rest or not self.tiers.has_store:
                load.is_done = True
                return True
            if not self.store_health.can_try():  # it failed a moment ago: recompute, do not wait on it
                load.is_done = True
                self.stats.num_store_reads_skipped += 1
                return True
            load.hashes = list(rest)
            load.give_up_at = time.monotonic() + self.config.load_deadline_s * 1.5 + 0.05
            load.future = self._run_io(self.tiers.read_store(load.hashes, deadline_after(self.config.load_deadline_s)))
            load.future.add_done_callback(self._on_load_done)
            self._num_pending_loads += 1
            self.stats.num_store_reads += 1
            self.stats.num_store_blocks_asked += len(rest)
            return False
        if not load.is_done:
            self._poll(req.request_id, load)
        return load.is_done

    def _on_load_done(self, _: Future) -> None:
        self._load_done.set()  # I/O thread: wake an idle engine loop (wait_for_loads)

    def _poll(self, request_id: str, load: _Load) -> None:
        fut = load.future
        if fut.done():
            load.is_done = True
            self._num_pending_loads -= 1
            try:
                read = fut.result()
            except Exception as exc:  # noqa: BLE001 - a broken store must never fail the request
                log.debug("request %s: store read failed (%s); recomputing", request_id, exc)
                self.stats.num_store_unavailable += 1
                self.store_health.on_failure(f"a read raised {type(exc).__name__}: {exc}")
                return
            load.staged = dict(zip(load.hashes, read.blocks))
            self.stats.num_store_blocks_hit += len(read.blocks)
            if read.is_deadline_miss:
                self.stats.num_deadline_misses += 1
                log.debug("request %s: store read missed its %.0f ms deadline after %d of %d blocks; recomputing the rest",
                          request_id, self.config.load_deadline_s * 1e3, len(read.blocks), len(load.hashes))
            elif read.end_status == GetStatus.UNAVAILABLE:
                self.stats.num_store_unavailable += 1
            self.store_health.on_read(read, len(load.hashes), self.config.load_deadline_s)
        elif time.monotonic() >= load.give_up_at:  # the store call itself overran: never wait on it
            fut.cancel()
            load.is_done = True
            self._num_pending_loads -= 1
            self.stats.num_deadline_misses += 1
            self.store_health.on_failure(f"a read of {len(load.hashes)} blocks was still running "
                                         f"{self.config.load_deadline_s * 1.5 + 0.05:.2f} s after it started")

    def extend_hits(self, req: Request, pool: BlockPool, hits: list[int], hashes: Sequence[BlockHash]) -> list[int]:
        """``hits`` (device blocks of ``hashes``' leading run) extended by blocks the host tier
        or this request's store read hold: each gets a fresh device block, registered in the pool
        now (so it is an ordinary prefix hit) and filled by the device thread before the next
        forward. One block is always left free for the request's first uncached chunk."""
        load = self._loads.get(req.request_id)
        staged = load.staged if load is not None else {}
        candidates: list[tuple[BlockHash, bytes, str]] = []
        for h in hashes[len(hits) :]:
            data = staged.get(h)
            tier = TIER_STORE
            if data is None:
                data, tier = self.tiers.host_get(h), TIER_HOST
            if data is None:
                break
            candidates.append((h, data, tier))
        if not candidates:
            return hits
        pool.touch(hits)  # the allocation below must not evict the device hits themselves
        num = min(len(candidates), pool.num_free_blocks - 1)
        new_ids = pool.allocate(num) if num > 0 else []
        kept: list[int] = []
        for block_id, (h, data, tier) in zip(new_ids, candidates):
            try:
                rows = self.codec.unpack(data)
            except BlockCodecError as exc:
                log.warning("kv block %s from the %s tier: %s; recomputing from there", h.hex(), tier, exc)
                self.stats.num_bad_payloads += 1
                break
            parent = hashes[len(hits) + len(kept) - 1] if hits or kept else None
            if not pool.cache_block(block_id, h, parent):
                break  # cannot happen (the walk stopped at the first cached miss); stay exact
            self.writes.promote(block_id, h, rows)
            kept.append(block_id)
            if tier == TIER_STORE:
                self.tiers.host_put(h, data)  # the next request finds it without a round trip
            if load is not None:
                load.promoted[h] = tier
            if tier == TIER_HOST:
                self.stats.num_loaded_host += 1
            else:
                self.stats.num_loaded_store += 1
        pool.free(hits + new_ids)  # kept ones become evictable cached blocks (device hits)
        return hits + kept

    def tier_split(self, req: Request, hits: Sequence[int], hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Cached tokens of an admission by the tier each hit block came from."""
        load = self._loads.get(req.request_id)
        promoted = load.promoted if load is not None else {}
        split = dict.fromkeys((TIER_DEVICE, TIER_HOST, TIER_STORE), 0)
        for h in hashes[: len(hits)]:
            split[promoted.get(h, TIER_DEVICE)] += self.block_size
        return split

    def forget(self, req: Request) -> None:
        """Admitted or released: drop the lookup state (cancel a read still running)."""
        load = self._loads.pop(req.request_id, None)
        if load is not None and not load.is_done:
            load.future.cancel()
            self._num_pending_loads -= 1

    # ---- write-behind (write_behind.py: engine thread queues, device thread copies, writer sends) ----
    def on_registered(self, blocks: Sequence[tuple[int, BlockHash]], traffic_class: str = "") -> None:
        """Blocks just registered in the prefix cache: write them behind, under the store's TTL
        class ``traffic_class`` ("" = the config's)."""
        self.writes.on_registered(blocks, traffic_class or self.config.traffic_class)

    def drain_store_written(self) -> list[BlockHash]:
        """Hashes of blocks the store acknowledged since the last call (cache events)."""
        return self.writes.drain_store_written()

    def take_device_io(self) -> Callable[[], None] | None:
        """The device work queued since the last call, to run right before the next forward."""
        return self.writes.take_device_io()

    def run_pending_device_io(self) -> None:
        """Run queued device work now: only when no forward is in flight (an idle engine)."""
        self.writes.run_pending_device_io()

    def submit_idle_device_io(self, device_executor) -> None:
        """The pipeline went idle after a commit: queue the last commit's copy-outs on the device thread now."""
        self.writes.submit_idle_device_io(device_executor)

    def wait_for_writes(self, timeout_s: float = 30.0) -> bool:
        """Block until every queued write-behind reached its tiers (tests, shutdown)."""
        return self.writes.wait_for_writes(timeout_s)

    # ---- waiting (engine loops and tests) -------------------------------------------------
    @property
    def num_pending_loads(self) -> int:
        return self._num_pending_loads

    def wait_for_loads(self, timeout_s: float) -> bool:
        """Block until some store read finished (an engine with nothing to run but requests
        waiting for KV); False at once when no read is pending."""
        if self._num_pending_loads == 0:
            return False
        is_set = self._load_done.wait(timeout_s)
        self._load_done.clear()
        return is_set
