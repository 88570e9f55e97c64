"""A storage node's scrub: re-verify the checksums of every stored fragment, at a bounded rate.

Reads only catch damage on fragments somebody reads; a cache holds much that is read rarely, and
a fragment that rots unread would be missing exactly when its object is next needed (and a second
loss in its group would make the object unreadable). So every ``interval_s`` the node walks all
its fragments, ``bytes_per_s`` at most, re-reading each file and checking its header and payload
CRC-32C (FragmentStore.scrub). A damaged fragment is deleted, a vanished file forgotten; both are
remembered as lost, and the node's repair (repair.py) has the object's leader rebuild them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.cache.store.rate import TokenBucket
from deepinfer.transport.protocol import FragmentStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScrubConfig:
    interval_s: float = 3600.0  # from the start of one pass to the next
    bytes_per_s: float = 50e6
    batch: int = 64  # fragments verified per trip to the I/O pool


@dataclass(slots=True)
class ScrubStats:
    num_scrubbed: int = 0
    num_errors: int = 0
    num_passes: int = 0


class Scrubber:
    def __init__(self, name: str, store, run_io: Callable, config: ScrubConfig = ScrubConfig()):
        self.name = name
        self.store = store
        self._run_io = run_io
        self.config = config
        self.stats = ScrubStats()
        self._bytes = TokenBucket(config.bytes_per_s, burst=max(config.bytes_per_s / 4, 1 << 20))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrub_pass()
            await asyncio.sleep(max(0.0, started + self.config.interval_s - loop.time()))

    async def scrub_pass(self) -> int:
        """Verify every fragment once; returns how many were damaged or gone."""
        keys = await self._run_io(self.store.keys_lru_first)
        num_errors = 0
        for i in range(0, len(keys), self.config.batch):
            chunk = keys[i : i + self.config.batch]
            statuses, num_bytes = await self._run_io(self._verify, chunk)
            self.stats.num_scrubbed += sum(s == FragmentStatus.OK for s in statuses)
            bad = [k for k, s in zip(chunk, statuses) if s in (FragmentStatus.CORRUPT, FragmentStatus.NOT_FOUND)]
            if bad:
                num_errors += len(bad)
                self.stats.num_errors += len(bad)  # counted at once: the pass may run long at its rate
                log.warning("%s: scrub found %d damaged or missing fragments (e.g. %s); their objects are rebuilt",
                            self.name, len(bad), bad[0].hex())
            await self._bytes.take(num_bytes)
        self.stats.num_passes += 1
        return num_errors

    def _verify(self, keys: list[bytes]) -> tuple[list[FragmentStatus | None], int]:
        statuses, num_bytes = [], 0
        for key in keys:
            status, size = self.store.scrub(key)  # None: gone meanwhile (GC, a newer write)
            statuses.append(status)
            num_bytes += size
        return statuses, num_bytes
