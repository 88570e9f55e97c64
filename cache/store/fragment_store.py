"""One storage node's fragments: files on local disk, a persistent index, checksums, LRU + TTL GC.

    ROOT/
      frags/<kk>/<key hex>     one self-describing file per fragment (see fragment_file.py)
      tmp/                     writes land here first, then rename into frags/ (atomic)
      index.sqlite3            key -> (file bytes, expires_at, last_access): what GC needs

The index is a cache of what the files say: ``open`` reconciles the two (rows without a file are
dropped, files without a row are adopted from their own headers), so a crash between a rename and
the index insert loses nothing, and a restart serves every fragment on disk without rewriting.
Reads refresh recency in memory; recency reaches the index in batches (``flush``) because a
restart that forgets the last seconds of reads only makes LRU slightly less exact.

Every read re-checks the file's checksums; a damaged fragment is counted, deleted and answered
CORRUPT, never served; what repair and scrub ask of the store (``scrub``, ``holding``, lost and
evicted keys) is in fragment_checks.py. Thread-safe: metadata changes happen under one lock, payload reads and
writes of temp files outside it, so a node may serve from a thread pool.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.ec import FragmentHeader, payload_crc
from deepinfer.cache.store.fragment_checks import MAX_LOST_KEYS, FragmentChecks
from deepinfer.cache.store.gc import GcEntry, TtlPolicy, Watermarks, is_expired, plan_gc
from deepinfer.transport.protocol import FragmentStatus  # statuses are wire values: the node sends them as is


@dataclass(slots=True)
class _Entry:
    num_bytes: int
    expires_at: float
    last_access: float
    index: int = -1  # fragment index, write id, payload crc: -1 until known (the index db does not keep them)
    write_id: int = 0
    payload_crc: int = 0
    written_at: float = 0.0  # 0: adopted from the index db after a restart (an old write)



class ReadResult(NamedTuple):
    status: FragmentStatus
    record: ff.FragmentRecord | None = None
    payload: memoryview | None = None


class GcReport(NamedTuple):
    num_expired: int
    num_evicted: int
    num_bytes_freed: int


@dataclass(slots=True)
class StoreStats:
    num_fragments: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    num_puts: int = 0
    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_expired: int = 0
    num_evicted: int = 0
    num_corrupt: int = 0
    num_rejected: int = 0
    num_bytes_written: int = 0
    num_bytes_read: int = 0


class FragmentStore(FragmentChecks):
    def __init__(
        self,
        root: str | Path,
        watermarks: Watermarks,
        ttl: TtlPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
        fsync: bool = False,
    ):
        self.root = Path(root)
        self.watermarks = watermarks
        self.ttl = ttl or TtlPolicy()
        self.clock = clock  # wall clock (expiry survives restarts); tests inject a fake one
        self.fsync = fsync
        self._frag_dir = self.root / "frags"
        self._tmp_dir = self.root / "tmp"
        self._lock = threading.RLock()
        self._lru: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._expiry_heap: list[tuple[float, bytes]] = []  # lazy: stale items skipped on pop
        self._dirty_access: set[bytes] = set()
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._stats = StoreStats(capacity_bytes=watermarks.capacity_bytes)
        self._db: sqlite3.Connection | None = None
        self._lost: deque[bytes] = deque(maxlen=MAX_LOST_KEYS)
        self._evicted: OrderedDict[bytes, None] = OrderedDict()  # recently evicted by LRU GC

    # ---- lifecycle ------------------------------------------------------------------------
    def open(self) -> "FragmentStore":
        self._frag_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        for i in range(256):  # every fan-out directory up front: no mkdir on the write path
            (self._frag_dir / f"{i:02x}").mkdir(exist_ok=True)
        for stale in self._tmp_dir.iterdir():  # writes a crash cut short
            stale.unlink(missing_ok=True)
        self._db = sqlite3.connect(self.root / "index.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS fragments (key BLOB PRIMARY KEY, num_bytes INTEGER NOT NULL,"
            " expires_at REAL NOT NULL, last_access REAL NOT NULL) WITHOUT ROWID"
        )
        self._reconcile()
        return self

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self.flush()
                self._db.close()
                self._db = None

    def __enter__(self) -> "FragmentStore":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _reconcile(self) -> None:
        rows = {k: _Entry(n, e, a) for k, n, e, a in self._db.execute("SELECT * FROM fragments")}
        on_disk: dict[bytes, int] = {}
        for sub in self._frag_dir.iterdir():
            if not sub.is_dir():
                continue
            for item in os.scandir(sub):
                try:
                    on_disk[bytes.fromhex(item.name)] = item.stat().st_size
                except ValueError:  # not a fragment file name
                    os.unlink(item.path)
        drop = [k for k in rows if k not in on_disk]
        adopt: dict[bytes, _Entry] = {}
        for key, size in on_disk.items():
            if key in rows:
                rows[key].num_bytes = size  # the file is the truth
                continue
            try:
                record = ff.read_prefix(ff.fragment_path(self._frag_dir, key))
            except (ff.CorruptFragment, OSError):
                ff.fragment_path(self._frag_dir, key).unlink(missing_ok=True)
                self._stats.num_corrupt += 1
                continue
            h = record.header
            adopt[key] = _Entry(size, record.expires_at, record.written_at, h.index, record.write_id, h.payload_crc, record.written_at)
        rows = {k: v for k, v in rows.items() if k in on_disk}
        rows.update(adopt)
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM fragments WHERE key = ?", [(k,) for k in drop])
            self._db.executemany(
                "INSERT OR REPLACE INTO fragments VALUES (?, ?, ?, ?)",
                [(k, e.num_bytes, e.expires_at, e.last_access) for k, e in rows.items()],
            )
            self._db.execute("COMMIT")
            for key, entry in sorted(rows.items(), key=lambda kv: kv[1].last_access):
                self._lru[key] = entry
                self._used_bytes += entry.num_bytes
                heapq.heappush(self._expiry_heap, (entry.expires_at, key))

    # ---- writes ---------------------------------------------------------------------------
    def put(self, header: FragmentHeader, payload, *, write_id: int, traffic_class: str) -> FragmentStatus:
        return self.put_many([(header, payload, write_id, traffic_class)])[0]

    def put_many(self, items: Sequence[tuple]) -> list[FragmentStatus]:
        """Store fragments (header, payload, write_id, traffic_class[, expires_at]); one status
        each, in order. ``expires_at`` (> 0) keeps a given expiry (a repaired fragment keeps its
        object's); otherwise the class's TTL counts from now. A fragment with the key of a stored
        one replaces it (the newest write of a key wins)."""
        now = self.clock()
        return [self._put_one(h, payload, write_id, cls, rest[0] if rest else 0.0, now)
                for h, payload, write_id, cls, *rest in items]  # fmt: skip

    def _put_one(self, header, payload, write_id, traffic_class, expires_at, now) -> FragmentStatus:
        view = memoryview(payload).cast("B")
        if payload_crc(view) != header.payload_crc or not header.key or len(header.key) > ff.MAX_KEY_BYTES:
            self._stats.num_rejected += 1
            return FragmentStatus.INVALID
        expires_at = expires_at if expires_at > 0 else self.ttl.expires_at(traffic_class, now)
        if is_expired(expires_at, now):  # a repair of an object that has just expired
            return FragmentStatus.EXPIRED
        record = ff.FragmentRecord(header, write_id, traffic_class, now, expires_at)
        try:
            prefix = ff.pack_prefix(record, view.nbytes)
        except ValueError:
            self._stats.num_rejected += 1
            return FragmentStatus.INVALID
        num_bytes = len(prefix) + view.nbytes
        if num_bytes > self.watermarks.capacity_bytes:
            self._stats.num_rejected += 1
            return FragmentStatus.TOO_LARGE
        if not self._reserve(num_bytes):
            self._stats.num_rejected += 1
            return FragmentStatus.NO_SPACE
        path = ff.fragment_path(self._frag_dir, header.key)
        tmp_path = self._tmp_dir / f"{path.name}.{threading.get_ident()}"  # unique per writer thread
        try:
            ff.write_new_file(tmp_path, prefix, view, fsync=self.fsync)
            with self._lock:
                os.replace(tmp_path, path)
                self._forget(header.key)
                self._evicted.pop(header.key, None)
                self._lru[header.key] = _Entry(num_bytes, record.expires_at, now, header.index, write_id, header.payload_crc, now)
                self._used_bytes += num_bytes
                heapq.heappush(self._expiry_heap, (record.expires_at, header.key))
                self._db.execute(
                    "INSERT OR REPLACE INTO fragments VALUES (?, ?, ?, ?)", (header.key, num_bytes, record.expires_at, now)
                )
                self._stats.num_puts += 1
                self._stats.num_bytes_written += view.nbytes
        except OSError:
            tmp_path.unlink(missing_ok=True)
            raise
        finally:
            with self._lock:
                self._reserved_bytes -= num_bytes
        return FragmentStatus.OK

    def _reserve(self, num_bytes: int) -> bool:
        """Claim room for a write; collect garbage first when it takes the node past the high mark
        (so GC keeps pace with writes between the daemon's periodic passes)."""
        with self._lock:
            if self._used_bytes + self._reserved_bytes + num_bytes > self.watermarks.high_bytes:
                self._collect(extra_bytes=self._reserved_bytes + num_bytes)
            if self._used_bytes + self._reserved_bytes + num_bytes > self.watermarks.capacity_bytes:
                return False
            self._reserved_bytes += num_bytes
            return True

    # ---- reads ----------------------------------------------------------------------------
    def get(self, key: bytes) -> ReadResult:
        """The fragment stored under ``key``, checksums verified."""
        with self._lock:
            self._stats.num_gets += 1
            entry = self._lru.get(key)
            if entry is None:
                self._stats.num_misses += 1
                return ReadResult(FragmentStatus.NOT_FOUND)
            if is_expired(entry.expires_at, self.clock()):
                self._delete(key)
                self._stats.num_expired += 1
                self._stats.num_misses += 1
                return ReadResult(FragmentStatus.EXPIRED)
        path = ff.fragment_path(self._frag_dir, key)
        try:
            record, payload = ff.parse(ff.read_file(path))
            if record.key != key:
                raise ff.CorruptFragment(f"file for {key.hex()} holds {record.key.hex()}")
        except FileNotFoundError:  # deleted (GC, replace) between lookup and read, or lost from the disk
            with self._lock:
                self._stats.num_misses += 1
                if self._lru.get(key) is entry and not path.exists():  # still indexed: the file vanished
                    self._forget_lost(key)
            return ReadResult(FragmentStatus.NOT_FOUND)
        except ff.CorruptFragment:
            with self._lock:
                self._stats.num_corrupt += 1
                self._stats.num_misses += 1
                if key in self._lru:
                    self._delete(key)
                    self._lost.append(key)
            return ReadResult(FragmentStatus.CORRUPT)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                entry.last_access = self.clock()
                self._lru.move_to_end(key)
                self._dirty_access.add(key)
            self._stats.num_hits += 1
            self._stats.num_bytes_read += payload.nbytes
        return ReadResult(FragmentStatus.OK, record, payload)

    def touch(self, keys: Sequence[bytes]) -> int:
        """Mark fragments as just used (a read that did not need this node's fragment)."""
        now = self.clock()
        num_touched = 0
        with self._lock:
            for key in keys:
                entry = self._lru.get(key)
                if entry is not None:
                    entry.last_access = now
                    self._lru.move_to_end(key)
                    self._dirty_access.add(key)
                    num_touched += 1
        return num_touched

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._lru

    def keys_lru_first(self) -> list[bytes]:
        with self._lock:
            return list(self._lru)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._lru:
                return False
            self._delete(key)
            return True

    # ---- garbage collection ---------------------------------------------------------------
    def run_gc(self) -> GcReport:
        with self._lock:
            return self._collect(extra_bytes=0)

    def _collect(self, extra_bytes: int) -> GcReport:
        now = self.clock()
        plan = plan_gc(self._expired_head(now), self._by_recency(), self._used_bytes + extra_bytes, self.watermarks, now)
        for key in plan.expired:
            self._delete(key)
        for key in plan.evicted:
            self._delete(key)
            self._evicted[key] = None  # repair must not write back what GC just made room from
        while len(self._evicted) > MAX_LOST_KEYS:
            self._evicted.popitem(last=False)
        self._stats.num_expired += len(plan.expired)
        self._stats.num_evicted += len(plan.evicted)
        return GcReport(len(plan.expired), len(plan.evicted), plan.num_bytes_freed)

    def _expired_head(self, now: float) -> Iterator[GcEntry]:
        heap = self._expiry_heap
        while heap and is_expired(heap[0][0], now):
            expires_at, key = heapq.heappop(heap)
            entry = self._lru.get(key)
            if entry is not None and entry.expires_at == expires_at:
                yield GcEntry(key, entry.num_bytes, expires_at)

    def _by_recency(self) -> Iterator[GcEntry]:
        for key, entry in list(self._lru.items()):
            yield GcEntry(key, entry.num_bytes, entry.expires_at)

    def _delete(self, key: bytes) -> None:
        self._forget(key)
        ff.fragment_path(self._frag_dir, key).unlink(missing_ok=True)
        self._db.execute("DELETE FROM fragments WHERE key = ?", (key,))

    def _forget(self, key: bytes) -> None:
        entry = self._lru.pop(key, None)
        if entry is not None:
            self._used_bytes -= entry.num_bytes
            self._dirty_access.discard(key)

    def flush(self) -> int:
        """Persist recency of fragments read since the last flush."""
        with self._lock:
            rows = [(self._lru[k].last_access, k) for k in self._dirty_access if k in self._lru]
            self._dirty_access.clear()
            if rows and self._db is not None:
                self._db.executemany("UPDATE fragments SET last_access = ? WHERE key = ?", rows)
            return len(rows)

    # ---- introspection --------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_fragments(self) -> int:
        return len(self._lru)

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{f: getattr(self._stats, f) for f in StoreStats.__slots__})
            s.num_fragments = len(self._lru)
            s.used_bytes = self._used_bytes
            return s

    def check_integrity(self) -> None:
        """Memory, index and disk agree (tests and debugging; walks everything)."""
        with self._lock:
            assert self._used_bytes == sum(e.num_bytes for e in self._lru.values()), "used bytes drifted"
            assert self._reserved_bytes == 0, f"{self._reserved_bytes} bytes reserved with no write in flight"
            rows = dict(self._db.execute("SELECT key, num_bytes FROM fragments"))
            assert rows.keys() == self._lru.keys(), "index rows and memory disagree"
            for key, entry in self._lru.items():
                path = ff.fragment_path(self._frag_dir, key)
                assert path.stat().st_size == entry.num_bytes == rows[key], f"size of {key.hex()} disagrees"
