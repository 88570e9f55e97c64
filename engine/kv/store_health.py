"""Whether the KV store is worth asking now, and the one log line per outage.

A dead or unreachable store fails every call only at its deadline: each request with a prefix
would wait ``load_deadline_s`` before recomputing, each write-behind batch would sit in flight for
``write_deadline_s``. After a call that got nothing back from the store (an error, or a read that
ended UNAVAILABLE or at its deadline with no block), calls of that kind skip the store for a
back-off that doubles while it keeps failing (``min_backoff_s`` .. ``max_backoff_s``); the first
call after it is the probe. Any call of that kind the store answered ends the outage. Reads and
writes keep separate outages: a cluster with k nodes up serves reads but takes no writes (a write
needs k+1), and one direction's failures must not switch the other off and on.

    ok ──failure──> out (skip until t+1s) ──probe fails──> out (t+2s) ... (t+max)
     ^                                                          │
     └───────────────────────── probe answered ─────────────────┘

Logs: one warning when an outage (of reads, or of writes) starts, one info line when it ends;
nothing per request in between (the counters in KVOffloadStats say how much was skipped).
Thread-safe: reads report from the engine thread, writes from the store's I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deepinfer.cache.kv_tiers import StoreRead
from deepinfer.cache.store.api import GetStatus
from deepinfer.cache.store.probe import ClusterProbe

log = logging.getLogger(__name__)


class _Backoff:
    """One direction's outage state: healthy (0) or backing off until ``retry_at``."""

    __slots__ = ("backoff_s", "retry_at", "num_outages")

    def __init__(self) -> None:
        self.backoff_s = 0.0
        self.retry_at = 0.0
        self.num_outages = 0


class StoreHealth:
    def __init__(self, *, min_backoff_s: float = 1.0, max_backoff_s: float = 16.0,
                 clock: Callable[[], float] = time.monotonic):
        assert 0 < min_backoff_s <= max_backoff_s, "back-off bounds must satisfy 0 < min <= max"
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reads = _Backoff()
        self._writes = _Backoff()

    # ---- reads (the names without "write": the store as a source of prefixes) -------------
    @property
    def is_out(self) -> bool:
        return self._reads.backoff_s > 0

    @property
    def num_outages(self) -> int:
        return self._reads.num_outages

    def can_try(self) -> bool:
        """False while reads back off; the first read after the back-off is let through as a probe."""
        return self._can(self._reads)

    def on_answer(self) -> None:
        """The store answered a read (a hit or a plain miss)."""
        if self._answered(self._reads):
            log.info("kv store answers again; prefix blocks are read from it again")

    def on_failure(self, what: str) -> None:
        """A read got nothing back from the store; ``what`` says which call and how it failed."""
        if self._failed(self._reads):
            log.warning("kv store unavailable: %s. Requests recompute their prefixes (counted in the kv store "
                        "metrics); retrying every %g-%g s", what, self.min_backoff_s, self.max_backoff_s)
        else:
            log.debug("kv store still unavailable: %s", what)

    # ---- writes (write-behind): an outage of their own, so that a store that serves reads but
    # cannot take writes (fewer than k+1 nodes up) neither stops reads nor flaps with them -------
    @property
    def is_write_out(self) -> bool:
        return self._writes.backoff_s > 0

    @property
    def num_write_outages(self) -> int:
        return self._writes.num_outages

    def can_write(self) -> bool:
        return self._can(self._writes)

    def on_write_answer(self) -> None:
        if self._answered(self._writes):
            log.info("kv store takes writes again; new blocks are written behind again")

    def on_write_failure(self, what: str) -> None:
        if self._failed(self._writes):
            log.warning("kv store does not take writes: %s. Write-behind is dropped (counted in the kv store "
                        "metrics); reads go on; retrying every %g-%g s", what, self.min_backoff_s, self.max_backoff_s)
        else:
            log.debug("kv store still takes no writes: %s", what)

    # ---- the back-off, per direction -------------------------------------------------------
    def _can(self, b: _Backoff) -> bool:
        with self._lock:
            if b.backoff_s == 0 or self._clock() >= b.retry_at:
                if b.backoff_s:  # one probe per back-off: the next waits for its verdict or a longer wait
                    b.retry_at = self._clock() + b.backoff_s
                return True
            return False

    def _answered(self, b: _Backoff) -> bool:
        """Ends an outage; True when there was one (say so once)."""
        with self._lock:
            was_out, b.backoff_s = b.backoff_s > 0, 0.0
        return was_out

    def _failed(self, b: _Backoff) -> bool:
        """Starts or extends an outage; True when it is a new one (warn once)."""
        with self._lock:
            is_new = b.backoff_s == 0
            b.backoff_s = self.min_backoff_s if is_new else min(2 * b.backoff_s, self.max_backoff_s)
            b.retry_at = self._clock() + b.backoff_s
            b.num_outages += is_new
        return is_new

    def on_read(self, read: StoreRead, num_asked: int, deadline_s: float) -> None:
        """A read that got any answer (a block, or a plain miss) shows the store is up."""
        if read.blocks or read.end_status in (None, GetStatus.MISS):
            self.on_answer()
        elif read.is_deadline_miss:
            self.on_failure(f"no block of a {num_asked}-block read arrived within its {deadline_s * 1e3:.0f} ms deadline")
        else:
            self.on_failure(f"a read of {num_asked} blocks found too few storage nodes up")

    def on_probe(self, probe: ClusterProbe) -> None:
        """The start-up probe (cache/store/probe.py): an outage when fewer than k nodes answer."""
        if not probe.is_usable:
            self.on_failure(f"at start, {probe.describe()}")
            self.on_write_failure(f"at start, {probe.describe()}")
        elif probe.silent:
            log.warning("kv store at start: %s; objects are read from the others", probe.describe())
        else:
            log.info("kv store: %s", probe.describe())
