"""Whether the KV store is worth asking now, and the one log line per outage.

A dead or unreachable store fails every call only at its deadline: each request with a prefix
would wait ``load_deadline_s`` before recomputing, each write-behind batch would sit in flight for
``write_deadline_s``. After a call that got nothing back from the store (an error, or a read that
ended UNAVAILABLE or at its deadline with no block), reads and writes skip the store for a back-off
that doubles while it keeps failing (``min_backoff_s`` .. ``max_backoff_s``); the first call after
it is the probe. Any call the store answered ends the outage.

    ok ──failure──> out (skip until t+1s) ──probe fails──> out (t+2s) ... (t+max)
     ^                                                          │
     └───────────────────────── probe answered ─────────────────┘

Logs: one warning when an outage starts (what failed), one info line when it ends; nothing per
request in between (the counters in KVOffloadStats say how much was skipped). Thread-safe: reads
report from the engine thread, writes from the store's I/O thread.
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


class StoreHealth:
    def __init__(self, *, min_backoff_s: float = 1.0, max_backoff_s: float = 16.0,
                 clock: Callable[[], float] = time.monotonic):
        assert 0 < min_backoff_s <= max_backoff_s, "back-off bounds must satisfy 0 < min <= max"
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff_s = 0.0  # 0: the store is believed healthy
        self._retry_at = 0.0
        self.num_outages = 0

    @property
    def is_out(self) -> bool:
        return self._backoff_s > 0

    def can_try(self) -> bool:
        """False while backing off; the first call after the back-off is let through as a probe."""
        with self._lock:
            if self._backoff_s == 0 or self._clock() >= self._retry_at:
                if self._backoff_s:  # one probe per back-off: the next waits for its verdict or a longer wait
                    self._retry_at = self._clock() + self._backoff_s
                return True
            return False

    def on_answer(self) -> None:
        """The store answered a call (hit, miss or an accepted write)."""
        with self._lock:
            was_out, self._backoff_s = self._backoff_s > 0, 0.0
        if was_out:
            log.info("kv store answers again; prefix blocks are read from it and written behind again")

    def on_failure(self, what: str) -> None:
        """A call got nothing back from the store; ``what`` says which call and how it failed."""
        with self._lock:
            is_new = self._backoff_s == 0
            self._backoff_s = self.min_backoff_s if is_new else min(2 * self._backoff_s, self.max_backoff_s)
            self._retry_at = self._clock() + self._backoff_s
            self.num_outages += is_new
        if is_new:
            log.warning("kv store unavailable: %s. Requests recompute their prefixes and write-behind is dropped "
                        "(counted in the kv store metrics); retrying every %g-%g s", what, self.min_backoff_s,
                        self.max_backoff_s)
        else:
            log.debug("kv store still unavailable: %s", what)

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
        elif probe.silent:
            log.warning("kv store at start: %s; objects are read from the others", probe.describe())
        else:
            log.info("kv store: %s", probe.describe())
