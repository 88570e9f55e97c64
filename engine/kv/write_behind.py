"""KV write-behind: blocks registered in the prefix cache copied out and sent to the host tier / store.

Who runs what (KVOffload owns this and delegates): the engine thread queues registered blocks
(``on_registered``) and promoted rows (``promote``); the device thread runs ``take_device_io``'s
job right before the next forward (copy out, then write promoted rows); the writer thread packs
the copies and puts them in the host tier, then hands a store write to the I/O loop. A store that
fails is backed off (kv_store_health.py); too many writes in flight drop (counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.store.api import deadline_after

log = logging.getLogger(__name__)

MAX_UNREAD_STORED = 1 << 16  # acknowledged hashes kept for drain_store_written (oldest dropped)


class WriteBehind:
    def __init__(self, tiers, runner, codec, config, stats, store_health, run_io: Callable[..., Future]) -> None:
        """The parts of the owning KVOffload: tiers, runner KV API, block codec, config, stats,
        store health, and ``run_io`` (a coroutine -> Future on its I/O loop)."""
        self.tiers = tiers
        self.runner = runner
        self.codec = codec
        self.config = config
        self.stats = stats
        self.store_health = store_health
        self._run_io = run_io
        self._copy_out: list[tuple[int, BlockHash, str]] = []  # registered (+ TTL class), not yet read
        self._device_writes: dict[int, tuple[BlockHash, dict[str, torch.Tensor]]] = {}  # block id -> rows
        self._store_writes: dict[Future, list[BlockHash]] = {}  # write-behind in flight -> its blocks
        self._stored: deque[BlockHash] = deque(maxlen=MAX_UNREAD_STORED)  # acknowledged, not yet drained
        self._store_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write-behind")
        self._is_closed = False

    def promote(self, block_id: int, block_hash: BlockHash, rows: dict[str, torch.Tensor]) -> None:
        """Rows of a block loaded from a tier, written into device block ``block_id`` before the next forward."""
        self._device_writes[block_id] = (block_hash, rows)

    def on_registered(self, blocks: Sequence[tuple[int, BlockHash]], traffic_class: str) -> None:
        self._copy_out.extend((block_id, h, traffic_class) for block_id, h in blocks)

    def drain_store_written(self) -> list[BlockHash]:
        """Hashes the store acknowledged since the last call (any thread)."""
        out = []
        while self._stored:
            out.append(self._stored.popleft())
        return out

    def take_device_io(self) -> Callable[[], None] | None:
        """The device work queued since the last call, to run right before the next forward."""
        if not self._copy_out and not self._device_writes:
            return None
        reads, self._copy_out = self._copy_out, []
        writes, self._device_writes = self._device_writes, {}
        return lambda: self._device_io(reads, writes)

    def run_pending_device_io(self) -> None:
        """Run queued device work now: only when no forward is in flight (an idle engine)."""
        io = self.take_device_io()
        if io is not None:
            io()

    def submit_idle_device_io(self, device_executor) -> None:
        """The pipeline went idle after a commit: queue the device work (the last commit's
        copy-outs) on the device thread now instead of waiting for the next plan, so a finished
        request's blocks reach the host tier / store while the engine has nothing to run."""
        io = self.take_device_io()
        if io is not None:
            device_executor.submit(self._run_logged, io)

    @staticmethod
    def _run_logged(io: Callable[[], None]) -> None:
        try:
            io()
        except Exception:  # nobody awaits this job: say what went wrong
            log.exception("kv tiers: idle device I/O failed")

    def _device_io(self, reads: list[tuple[int, BlockHash, str]], writes: dict[int, tuple[BlockHash, dict]]) -> None:
        if reads and not self._is_closed:  # first: a block registered before may be re-promoted below
            stacked = self.runner.read_blocks([b for b, _, _ in reads])
            self.stats.num_copied_out += len(reads)
            self._writer.submit(self._write_behind, [h for _, h, _ in reads], [c for _, _, c in reads], stacked)
        if writes:
            ids = list(writes)
            self.runner.write_blocks(ids, {s.key: torch.stack([writes[b][1][s.key] for b in ids]) for s in self.codec.specs})

    def _write_behind(self, hashes: list[BlockHash], classes: list[str], stacked: dict[str, torch.Tensor]) -> None:
        payloads = self.codec.pack_many(stacked)
        if self.config.write_to_host:
            for h, data in zip(hashes, payloads):
                self.tiers.host_put(h, data)
        if not (self.config.write_to_store and self.tiers.has_store):
            return
        # one store write per TTL class (the class travels per write, not per block)
        class2items: dict[str, list[tuple[BlockHash, bytes]]] = {}
        for h, cls, data in zip(hashes, classes, payloads):
            class2items.setdefault(cls, []).append((h, data))
        for traffic_class, items in class2items.items():
            with self._store_lock:
                if len(self._store_writes) >= self.config.max_store_writes_in_flight or not self.store_health.can_write():
                    self.stats.num_store_writes_dropped += len(items)
                    continue
                fut = self._run_io(self.tiers.write_store(items, traffic_class=traffic_class,
                                                          deadline=deadline_after(self.config.write_deadline_s)))
                self._store_writes[fut] = [h for h, _ in items]
            fut.add_done_callback(self._on_store_written)

    def _on_store_written(self, fut: Future) -> None:
        with self._store_lock:
            block_hashes = self._store_writes.get(fut, [])
        try:
            self._account(fut, block_hashes)
        finally:  # only now: wait_for_writes returns once the counters say what happened
            with self._store_lock:
                self._store_writes.pop(fut, None)

    def _account(self, fut: Future, block_hashes: list[BlockHash]) -> None:
        if fut.cancelled():  # abandoned by close(): not written, and counted so
            self.stats.num_store_writes_dropped += len(block_hashes)
            return
        exc = fut.exception()
        if exc is not None:
            self.stats.num_store_write_failures += 1
            self.store_health.on_write_failure(f"a write-behind raised {type(exc).__name__}: {exc}")
            return
        res = fut.result()
        self._stored.extend(h for h, ok in zip(block_hashes, res.is_ok) if ok)
        self.stats.num_written_store += res.num_ok
        self.stats.num_store_write_failures += res.num_failed
        if res.num_ok:
            self.store_health.on_write_answer()
        elif res.num_failed:
            self.store_health.on_write_failure(f"no block of a {res.num_failed}-block write-behind was stored "
                                         f"({res.first_error})")
        if res.num_failed and res.num_ok:
            log.debug("kv write-behind: %d blocks not stored (%s)", res.num_failed, res.first_error)

    def wait_for_writes(self, timeout_s: float = 30.0) -> bool:
        """Block until every queued write-behind reached its tiers (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        self._writer.submit(lambda: None).result(timeout=timeout_s)  # FIFO: earlier packs are done
        while True:
            with self._store_lock:
                pending = list(self._store_writes)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for fut in pending:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - counted by _on_store_written
                    pass

    def close(self) -> list[Future]:
        """Stop the writer; the store writes still in flight (for the owner to cancel)."""
        self._is_closed = True
        self._writer.shutdown(wait=True)
        with self._store_lock:
            return list(self._store_writes)
