"""A token bucket: background work (repair, scrub) takes at most ``rate`` units per second.

    bucket = TokenBucket(rate=200e6, burst=16e6)   # bytes/s, and how much may go at once
    await bucket.take(len(payload))                 # sleeps when the bucket is empty

``delay_for`` is the pure part (how long until ``amount`` may go), on an injectable clock. A take
larger than the burst is allowed (it drives the bucket negative) so one big object never blocks
forever; the next takes wait it off. ``rate`` 0 means unlimited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None, *, clock: Callable[[], float] = time.monotonic):
        assert rate >= 0, f"rate must be >= 0, got {rate}"
        self.rate = rate
        self.burst = burst if burst is not None else rate  # one second's worth by default
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def delay_for(self, amount: float) -> float:
        """Seconds to wait before ``amount`` may go (0: now); does not take anything."""
        if self.rate == 0:
            return 0.0
        self._refill()
        return 0.0 if self._tokens >= min(amount, self.burst) else (min(amount, self.burst) - self._tokens) / self.rate

    def consume(self, amount: float) -> None:
        if self.rate:
            self._refill()
            self._tokens -= amount

    async def take(self, amount: float) -> None:
        while (delay := self.delay_for(amount)) > 0:
            await asyncio.sleep(delay)
        self.consume(amount)
