"""The storage node daemon: a FragmentStore served over a ZeroMQ ROUTER, with GC on a timer.

    DEALER (store clients) ──> ROUTER ──> handler task per request ──> thread pool ──> FragmentStore
                                                                         (disk I/O, checksums)
    timer: every gc_interval_s run GC (TTL + watermarks), every flush_interval_s persist recency
    scrub (scrub.py): verify every fragment's checksums, ``scrub.bytes_per_s`` at most
    repair (repair.py, with a membership file): rebuild missing fragments, move misplaced ones

Disk work never runs on the event loop: puts, gets and GC go to a small thread pool (file I/O and
CRC-32C release the GIL), so one slow disk read does not hold up other requests' replies.

Test-only knobs (hidden from --help, never for production): ``debug_delay_ms`` sleeps before
answering every request (a slow node, for the hedging tests); ``debug_hooks`` accepts DebugSet
requests, which set the node's wall clock (TTL tests on real daemons) and its delay at run time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.cache.store.admin_policy import AdminPolicy
from deepinfer.cache.store.ec import FragmentHeader
from deepinfer.cache.store.fragment_store import FragmentStore
from deepinfer.cache.store.gc import TtlPolicy, Watermarks
from deepinfer.cache.store.repair import RepairConfig, Repairer
from deepinfer.cache.store.scrub import ScrubConfig, Scrubber
from deepinfer.transport.protocol import (
    DebugSet,
    FragmentIndex,
    FragmentMeta,
    FragmentsReply,
    FragmentStatus,
    GcDone,
    GetFragments,
    HasFragments,
    PutAck,
    PutFragments,
    RepairHint,
    RepairHintAck,
    RunGc,
    StorageRequest,
    StorageStats,
    StorageStatsRequest,
    TouchAck,
    TouchFragments,
)
from deepinfer.transport.channels import Incoming, RequestServer, WithBuffers
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import ErrorCode
from deepinfer.transport.security import ClientAllowList, CurveServerKeys

log = logging.getLogger(__name__)

MAX_FRAGMENT_BYTES = 256 * 1024 * 1024  # one attachment (a fragment of a 2.5 GB object at k=10)
# libzmq cuts off (disconnects) a peer sending a larger frame before buffering it: a node never
# holds more than this per frame, whatever a peer sends (the slack covers the message bodies)
MAX_RECEIVE_FRAME_BYTES = MAX_FRAGMENT_BYTES + 1024 * 1024
ADMIN_MESSAGES = (RunGc, DebugSet)


@dataclass(frozen=True, slots=True)
class StorageNodeConfig:
    dir: Path
    listen: str = "tcp://127.0.0.1:7600"
    capacity_bytes: int = 10 * 1024**3
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    ttl: TtlPolicy = field(default_factory=TtlPolicy)
    name: str = ""
    gc_interval_s: float = 1.0
    flush_interval_s: float = 5.0
    num_io_threads: int = 4
    fsync: bool = False
    admin: AdminPolicy = AdminPolicy()
    membership_file: Path | None = None  # set: repair runs (this node's name must be a member)
    repair: RepairConfig = field(default_factory=RepairConfig)
    scrub: ScrubConfig = field(default_factory=ScrubConfig)
    curve: CurveServerKeys | None = None  # set: the ROUTER speaks CURVE
    # with curve: client keys a ZAP allow list admits (empty: any CURVE client); None: the
    # process already runs a ZAP handler (``deepinfer node`` does)
    curve_client_keys: tuple[bytes, ...] | None = ()
    debug_delay_ms: float = 0.0  # test-only
    debug_hooks: bool = False  # test-only


class _SettableClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class RateMeter:
    """Bytes per second of a growing counter over the last ``window`` samples."""

    def __init__(self, window: int = 5):
        self._samples: deque[tuple[float, int]] = deque(maxlen=window + 1)

    def sample(self, num_bytes: int, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, num_bytes))

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


class StorageNode:
    def __init__(self, config: StorageNodeConfig):
        self.config = config
        self.name = config.name or Path(config.dir).name
        self._clock = _SettableClock() if config.debug_hooks else time.time
        self._delay_s = config.debug_delay_ms / 1000
        self.store = FragmentStore(
            config.dir,
            Watermarks(config.capacity_bytes, config.high_watermark, config.low_watermark),
            config.ttl,
            clock=self._clock,
            fsync=config.fsync,
        )
        self._pool = ThreadPoolExecutor(max_workers=config.num_io_threads, thread_name_prefix=f"store-{self.name}")
        self._server = RequestServer(
            config.listen, StorageRequest, self._handle, curve=config.curve, max_attachment_bytes=MAX_FRAGMENT_BYTES,
            hard_max_bytes=MAX_RECEIVE_FRAME_BYTES, name=f"storage-{self.name}",
        )
        self._allow_list: ClientAllowList | None = None
        self.num_admin_refused = 0
        self.scrubber = Scrubber(self.name, self.store, self._run_io, config.scrub)
        self.repairer = (Repairer(self.name, self.store, self._run_io, config.membership_file, config.repair)
                         if config.membership_file else None)  # fmt: skip
        self._background: list[asyncio.Task] = []
        self._timer_task: asyncio.Task | None = None
        self._started_at = time.monotonic()
        self._read_rate = RateMeter()
        self._write_rate = RateMeter()
        self.address = config.listen
        self._is_stopped = False

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.store.open)
        if self.config.curve is not None and self.config.curve_client_keys is not None:
            from deepinfer.transport.sockets import default_context

            keys = self.config.curve_client_keys
            self._allow_list = ClientAllowList(default_context(), keys or None)
            await self._allow_list.start()
        self.address = await self._server.start()
        self._timer_task = asyncio.create_task(self._timer(), name=f"storage-{self.name}-gc")
        self._background.append(asyncio.create_task(self._guarded(self.scrubber.run), name=f"storage-{self.name}-scrub"))
        if self.repairer is not None:
            self._background.append(asyncio.create_task(self._guarded(self.repairer.run), name=f"storage-{self.name}-repair"))
        return self.address

    async def _run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _guarded(self, run) -> None:
        """Run a background loop; a bug in it is logged and the loop restarted after a pause."""
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: %s failed; restarting it in 5 s", self.name, run.__qualname__)
                await asyncio.sleep(5.0)

    @property
    def num_in_flight(self) -> int:
        return self._server.num_in_flight

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests; give in-flight ones up to ``deadline_s`` to finish."""
        await self._server.drain(deadline_s)

    async def stop(self, drain_s: float = 2.0) -> None:
        """Drain (up to ``drain_s``), stop GC, persist recency, close. Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        await self._server.drain(drain_s)
        await self._server.close()
        for task in [self._timer_task, *self._background]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._timer_task, *self._background] if t is not None), return_exceptions=True)
        if self.repairer is not None:
            await self.repairer.close()
        await asyncio.get_running_loop().run_in_executor(self._pool, self.store.close)
        self._pool.shutdown(wait=True)
        if self._allow_list is not None:
            self._allow_list.stop()

    async def _timer(self) -> None:
        loop = asyncio.get_running_loop()
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                report = await loop.run_in_executor(self._pool, self.store.run_gc)
                if report.num_expired or report.num_evicted:
                    log.info("%s: gc expired %d, evicted %d fragments (%d bytes)", self.name, *report)
                if time.monotonic() - last_flush >= self.config.flush_interval_s:
                    await loop.run_in_executor(self._pool, self.store.flush)
                    last_flush = time.monotonic()
                stats = self.store.stats()
                self._read_rate.sample(stats.num_bytes_read)
                self._write_rate.sample(stats.num_bytes_written)
            except Exception:  # a failed pass (disk error) is logged and retried on the next tick
                log.exception("%s: gc pass failed", self.name)

    # ---- requests -----------------------------------------------------------------------
    async def _handle(self, incoming: Incoming):
        if self._delay_s > 0:
            await asyncio.sleep(self._delay_s)
        msg = incoming.msg
        loop = asyncio.get_running_loop()
        if isinstance(msg, ADMIN_MESSAGES):
            refusal = self.config.admin.refusal(incoming.peer_property("Peer-Address"), incoming.peer_property("User-Id"))
            if refusal:
                self.num_admin_refused += 1
                if self.num_admin_refused <= 10 or self.num_admin_refused % 1000 == 0:  # a flood must not flood logs
                    log.warning("%s: refused %s (%d so far): %s", self.name, type(msg).__name__, self.num_admin_refused, refusal)
                raise TransportError(f"{type(msg).__name__} refused: {refusal}", ErrorCode.FORBIDDEN)
        match msg:
            case GetFragments():
                return await loop.run_in_executor(self._pool, self._get, msg, time.monotonic())
            case PutFragments():
                if len(incoming.buffers) != len(msg.fragments):
                    raise TransportError(
                        f"PutFragments has {len(msg.fragments)} fragments but {len(incoming.buffers)} payloads",
                        ErrorCode.MALFORMED,
                    )
                return await loop.run_in_executor(self._pool, self._put, msg, incoming.buffers)
            case TouchFragments():
                return TouchAck(self.store.touch(msg.keys))
            case HasFragments():
                return await loop.run_in_executor(self._pool, self._has, msg.keys)
            case RepairHint():
                return RepairHintAck(self.repairer.hint(msg.keys) if self.repairer is not None else 0)
            case StorageStatsRequest():
                return self.stats()
            case RunGc():
                return GcDone(*await loop.run_in_executor(self._pool, self.store.run_gc))
            case DebugSet():
                if not isinstance(self._clock, _SettableClock):
                    raise TransportError("DebugSet needs a node started with --debug-hooks", ErrorCode.UNEXPECTED_MESSAGE)
                if msg.now > 0:
                    self._clock.now = msg.now
                if msg.delay_ms >= 0:
                    self._delay_s = msg.delay_ms / 1000
                return GcDone(*await loop.run_in_executor(self._pool, self.store.run_gc))
        raise TransportError(f"storage node cannot handle {type(msg).__name__}", ErrorCode.UNEXPECTED_MESSAGE)

    def _get(self, msg: GetFragments, arrived_at: float) -> WithBuffers:
        deadline = arrived_at + msg.timeout_ms / 1000 if msg.timeout_ms > 0 else float("inf")
        statuses: list[FragmentStatus] = []
        metas: list[FragmentMeta] = []
        payloads: list[memoryview] = []
        for key in msg.keys:
            if time.monotonic() > deadline:  # the caller has given up on this reply
                statuses.append(FragmentStatus.NOT_FOUND)
                continue
            result = self.store.get(key)
            statuses.append(result.status)
            if result.payload is not None:
                h, rec = result.record.header, result.record
                metas.append(FragmentMeta(h.key, h.index, h.k, h.m, h.object_size, h.payload_crc, rec.write_id))
                payloads.append(result.payload)
        return WithBuffers(FragmentsReply(statuses, metas), payloads)

    def _put(self, msg: PutFragments, buffers: list[memoryview]) -> PutAck:
        items = [
            (FragmentHeader(f.key, f.index, f.k, f.m, f.object_size, f.payload_crc), buf, f.write_id, msg.traffic_class,
             f.expires_at)
            for f, buf in zip(msg.fragments, buffers)
        ]  # fmt: skip
        return PutAck(self.store.put_many(items))

    def _has(self, keys: list[bytes]) -> FragmentIndex:
        indices, write_ids, crcs = [], [], []
        for key in keys:  # -2: evicted by GC lately (repair leaves the object to age out)
            index, write_id, crc = self.store.holding(key) or ((-2 if self.store.was_evicted(key) else -1), 0, 0)
            indices.append(index)
            write_ids.append(write_id)
            crcs.append(crc)
        return FragmentIndex(indices, write_ids, crcs)

    def stats(self) -> StorageStats:
        s = self.store.stats()
        wm = self.store.watermarks
        return StorageStats(
            node_name=self.name,
            num_fragments=s.num_fragments,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            high_watermark_bytes=wm.high_bytes,
            low_watermark_bytes=wm.low_bytes,
            num_puts=s.num_puts,
            num_gets=s.num_gets,
            num_hits=s.num_hits,
            num_misses=s.num_misses,
            num_expired=s.num_expired,
            num_evicted=s.num_evicted,
            num_corrupt=s.num_corrupt,
            num_rejected=s.num_rejected,
            num_bytes_written=s.num_bytes_written,
            num_bytes_read=s.num_bytes_read,
            read_GBps=self._read_rate.rate() / 1e9,
            write_GBps=self._write_rate.rate() / 1e9,
            uptime_s=time.monotonic() - self._started_at,
            num_scrubbed=self.scrubber.stats.num_scrubbed,
            num_scrub_errors=self.scrubber.stats.num_errors,
            num_admin_refused=self.num_admin_refused,
            **self._repair_stats(),
        )

    def _repair_stats(self) -> dict:
        r = self.repairer
        if r is None:
            return {}
        return dict(
            num_repaired=r.stats.num_repaired, num_moved=r.stats.num_moved, num_dropped=r.stats.num_dropped,
            num_repair_bytes=r.stats.num_repair_bytes, num_repair_failures=r.stats.num_repair_failures,
            num_under_replicated=r.num_under_replicated, num_audited=r.stats.num_audited,
            audit_progress=r.audit_progress, membership_epoch=r.epoch,
        )  # fmt: skip
