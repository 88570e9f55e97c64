"""The ``fs`` backend: whole objects as fragment files under a mounted directory.

For sites that already run a distributed file system (NFS, or a real 3FS FUSE mount in
production) and let it provide durability: no erasure coding here, each object is one file in
the storage nodes' own format (fragment_file.py, coded k=1 m=0), so checksums, retention and the
directory layout are the same as on a storage node:

    ROOT/objects/<kk>/<key hex>     header (key, class, written_at, expires_at, crc) + object
    ROOT/tmp/                       writes land here, then rename (atomic on POSIX and 3FS)

Many engines may share one ROOT. Reads refresh the file's mtime so that ``run_gc`` (run by one
designated process, e.g. on a timer) can evict least-recently-used objects past a watermark and
delete expired ones. File I/O runs on a thread pool; the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.api import ClientStats, GetResult, GetStatus, PutResult, seconds_left
from deepinfer.cache.store.ec import ECConfig, ErasureCodec
from deepinfer.cache.store.gc import GcEntry, GcPlan, TtlPolicy, Watermarks, is_expired, plan_gc

_WHOLE = ECConfig(k=1, m=0)


class FsStore:
    def __init__(
        self,
        root: str | Path,
        *,
        ttl: TtlPolicy | None = None,
        clock: Callable[[], float] = time.time,
        num_io_threads: int = 8,
        fsync: bool = False,
    ):
        self.root = Path(root)
        self.ttl = ttl or TtlPolicy()
        self.clock = clock
        self.fsync = fsync
        self.stats = ClientStats()
        self.num_corrupt = 0
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._codec = ErasureCodec(_WHOLE)
        self._pool = ThreadPoolExecutor(max_workers=num_io_threads, thread_name_prefix="fs-store")

    async def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- ObjectStore --------------------------------------------------------------------
    async def get_blocks(self, keys: Sequence[bytes], deadline: float) -> list[GetResult]:
        loop = asyncio.get_running_loop()
        if seconds_left(deadline) <= 0:  # too late already: no reads (a quick one would race the timeout)
            results = [None] * len(keys)
        else:
            results = await _gather_until([loop.run_in_executor(self._pool, self._read, key) for key in keys], deadline)
        out: list[GetResult] = []
        for key, res in zip(keys, results):
            if res is None:
                res = GetResult(key, GetStatus.DEADLINE)
                self.stats.num_deadline_misses += 1
            elif isinstance(res, _Corrupt):
                res = GetResult(key, GetStatus.MISS)
                self.num_corrupt += 1
            out.append(res)
            if res.is_hit:
                self.stats.num_hits += 1
                self.stats.num_bytes_read += len(res.data)
            elif res.status == GetStatus.MISS:
                self.stats.num_misses += 1
        self.stats.num_gets += len(keys)
        return out

    async def put_blocks(self, items: Sequence[tuple[bytes, object]], *, traffic_class: str, deadline: float) -> list[PutResult]:
        loop = asyncio.get_running_loop()
        write_id = random.getrandbits(63)
        futures = [loop.run_in_executor(self._pool, self._write, key, data, traffic_class, write_id) for key, data in items]
        results = await _gather_until(futures, deadline)
        out: list[PutResult] = []
        for (key, _), res in zip(items, results):
            if res is None:
                out.append(PutResult(key, False, 0, "deadline passed"))
                continue
            result, num_bytes = res
            out.append(result)
            self.stats.num_bytes_written += num_bytes
        self.stats.num_puts += len(out)
        self.stats.num_put_failures += sum(not r.is_ok for r in out)
        return out

    # ---- file I/O (worker threads) ------------------------------------------------------
    def _write(self, key: bytes, data, traffic_class: str, write_id: int) -> tuple[PutResult, int]:
        try:
            ff.validate_key(key)
            (whole,) = self._codec.encode(key, data)
            now = self.clock()
            record = ff.FragmentRecord(whole.header, write_id, traffic_class, now, self.ttl.expires_at(traffic_class, now))
            prefix = ff.pack_prefix(record, len(whole.payload))
            path = ff.fragment_path(self._objects, key)
            path.parent.mkdir(exist_ok=True)
            tmp = self._tmp / f"{path.name}.{os.getpid()}.{write_id:x}"
            ff.write_new_file(tmp, prefix, whole.payload, fsync=self.fsync)
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            return PutResult(key, False, 0, f"{type(exc).__name__}: {exc}"), 0
        return PutResult(key, True, 1), len(whole.payload)

    def _read(self, key: bytes) -> GetResult | _Corrupt:
        path = ff.fragment_path(self._objects, key)
        try:
            record, payload = ff.parse(ff.read_file(path))
        except FileNotFoundError:
            return GetResult(key, GetStatus.MISS)
        except ff.CorruptFragment:
            path.unlink(missing_ok=True)  # never served; a later write repairs it
            return _Corrupt()
        if record.key != key or is_expired(record.expires_at, self.clock()):
            return GetResult(key, GetStatus.MISS)
        try:
            os.utime(path)  # recency for run_gc's LRU
        except OSError:
            pass
        return GetResult(key, GetStatus.HIT, bytes(payload))

    # ---- garbage collection (one designated process) ------------------------------------
    def run_gc(self, watermarks: Watermarks) -> GcPlan:
        """Delete expired objects, then LRU (by mtime) ones past the high watermark."""
        now = self.clock()
        entries: list[tuple[float, GcEntry]] = []
        used = 0
        for sub in self._objects.iterdir():
            if not sub.is_dir():
                continue
            for item in os.scandir(sub):
                try:
                    st = item.stat()
                    record = ff.read_prefix(Path(item.path))
                except (OSError, ff.CorruptFragment):
                    continue
                used += st.st_size
                entries.append((st.st_mtime, GcEntry(record.key, st.st_size, record.expires_at)))
        by_expiry = sorted((e for _, e in entries), key=lambda e: e.expires_at)
        by_recency = [e for _, e in sorted(entries, key=lambda pair: pair[0])]
        plan = plan_gc(by_expiry, by_recency, used, watermarks, now)
        for key in [*plan.expired, *plan.evicted]:
            ff.fragment_path(self._objects, key).unlink(missing_ok=True)
        return plan


class _Corrupt:
    """A worker's answer for a file that failed its checksums (counted on the loop thread)."""


async def _gather_until(futures: list[asyncio.Future], deadline: float) -> list:
    """Results of ``futures`` in order, None for those not done by ``deadline`` (then cancelled)."""
    if not futures:
        return []
    timeout = max(0.0, seconds_left(deadline))
    try:
        done, _ = await asyncio.wait(futures, timeout=timeout)
    finally:  # deadline or the caller cancelled: queued work is dropped, running work finishes unseen
        for f in futures:
            if not f.done():
                f.cancel()
    return [f.result() if f in done and not f.cancelled() else None for f in futures]
