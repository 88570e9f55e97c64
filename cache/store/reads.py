"""The read path of ClusterStore (client.py): hedged reads of many objects at once.

Per object ask the first k+1 usable nodes of its read window (placement.py), one GetFragments per
node for the whole batch; decode as soon as k fragments of one write are in (read_state.py). The
rest of the window is asked when an answer shows the first wave cannot reach k, or when the hedge
delay passes first. Unusable nodes (node_health.py) are never asked: a key that cannot reach k
fragments ends at once as UNAVAILABLE naming them, and requests in flight to a node whose
connection drops are cancelled then (the read goes on without it). A key not assembled by the
deadline is a typed DEADLINE miss; the caller recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from deepinfer.cache.store import writes
from deepinfer.cache.store.api import GetResult, GetStatus, seconds_left
from deepinfer.cache.store.ec import ErasureCodingError, Fragment, FragmentHeader
from deepinfer.cache.store.read_state import KeyRead
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import FragmentsReply, FragmentStatus, GetFragments, TouchFragments

log = logging.getLogger(__name__)


async def get_objects(store, keys: Sequence[bytes], deadline: float) -> list[GetResult]:
    """One result per key, in order; never raises for a missing or late object."""
    k = store.config.ec.k
    results: list[GetResult | None] = [None] * len(keys)
    unusable, suspects = store.health.unusable(), store.health.suspects()
    reads: dict[int, KeyRead] = {}
    node2positions: dict[str, list[int]] = defaultdict(list)
    for pos, key in enumerate(keys):
        order, skipped = _read_window(store, key, unusable, suspects)
        read = KeyRead(key, k, order, store.config.first_wave, skipped)
        if len(order) < k:
            results[pos] = _unavailable(store, read)
            continue
        reads[pos] = read
        for node in read.start():
            node2positions[node].append(pos)
    tasks: dict[asyncio.Task, tuple[str, list[int]]] = {}
    try:
        _launch(store, tasks, node2positions, keys, deadline)
        await _collect(store, tasks, reads, results, keys, deadline)
    finally:  # done, deadline or cancelled: nothing of this call keeps running
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    _touch_unasked(store, reads, results)
    if store.config.send_repair_hints:
        hint_short_reads(store, reads, results)
    return _finish_gets(store, results, keys)


def _read_window(store, key: bytes, unusable: set[str], suspects: set[str]) -> tuple[list[str], list[str]]:
    """(nodes to ask in order, unusable nodes ranked among them); suspects go last."""
    n = store.config.ec.num_fragments
    order, skipped = store.placement.read_window(key, n, n + store.config.num_spare_nodes + len(store.draining),
                                                unusable, store.draining)  # fmt: skip
    if suspects:
        order = [n for n in order if n not in suspects] + [n for n in order if n in suspects]
    return order, skipped


def _unavailable(store, read: KeyRead) -> GetResult:
    nodes = read.unavailable_nodes()
    detail = ", ".join(f"{n} {store.health.why(n)}" for n in nodes[:6]) + (", ..." if len(nodes) > 6 else "")
    return GetResult(read.key, GetStatus.UNAVAILABLE, message=f"fewer than k={read.k} of its nodes usable: {detail}")


def _launch(store, tasks, node2positions, keys, deadline) -> None:
    for node, positions in node2positions.items():
        msg = GetFragments([keys[p] for p in positions], timeout_ms=max(0.0, seconds_left(deadline)) * 1000)
        coro = store.client_of(node).request_with_buffers(msg, timeout_s=max(0.001, seconds_left(deadline)))
        tasks[store.request_task(node, coro)] = (node, positions)


async def _collect(store, tasks, reads: dict[int, KeyRead], results, keys, deadline) -> None:
    # A big batch takes longer to serve everywhere; only lateness beyond that is a straggler.
    num_keys = max((len(p) for _, p in tasks.values()), default=1)
    hedge_at = time.monotonic() + store.config.hedge_delay_s + store.config.hedge_delay_per_key_s * num_keys
    open_positions = set(reads)
    pending = set(tasks)
    while open_positions:
        now = time.monotonic()
        if now >= deadline:
            return
        timeout = deadline - now if now >= hedge_at else min(hedge_at, deadline) - now
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            _on_reply(store, task, tasks[task], reads)
        hedges: dict[str, list[int]] = defaultdict(list)
        is_timer = time.monotonic() >= hedge_at
        for pos in list(open_positions):
            read = reads[pos]
            if read.is_ready:
                results[pos] = _decode(store, read)
                open_positions.discard(pos)
                continue
            if read.must_hedge_now or (is_timer and not read.is_hedged):
                if is_timer and len(read.pending) * 2 < len(read.first_wave):
                    # most of the wave answered in time: the stragglers are outliers, not load
                    for node in read.pending:
                        store.health.suspect(node)
                extra = read.hedge()
                store.stats.num_hedged += bool(extra)
                unusable = store.health.unusable()
                for node in extra:
                    if node in unusable:  # lost since the read began: asking it would wait for the deadline
                        read.on_failed(node)
                    else:
                        hedges[node].append(pos)
            if read.is_hopeless:
                results[pos] = _unavailable(store, read) if read.is_unavailable else GetResult(read.key, GetStatus.MISS)
                open_positions.discard(pos)
        if hedges:
            before = set(tasks)
            _launch(store, tasks, hedges, keys, deadline)
            pending |= set(tasks) - before
        if is_timer:
            hedge_at = float("inf")
        if not pending and open_positions:  # nobody left to ask (cannot happen with a sane order)
            for pos in open_positions:
                results[pos] = GetResult(keys[pos], GetStatus.MISS)
            return


def _on_reply(store, task: asyncio.Task, meta: tuple[str, list[int]], reads: dict[int, KeyRead]) -> None:
    node, positions = meta
    try:
        reply, buffers = task.result()
    except (TransportError, asyncio.CancelledError) as exc:  # cancelled: the node's connection was lost
        if isinstance(exc, TransportError):
            store.health.suspect(node)
            log.debug("store read from %s failed: %s", node, exc)
        for pos in positions:
            reads[pos].on_failed(node)
        return
    if not isinstance(reply, FragmentsReply) or len(reply.statuses) != len(positions) or len(reply.fragments) != len(buffers):
        log.warning("store node %s sent a malformed reply to GetFragments", node)
        for pos in positions:
            reads[pos].on_failed(node)
        return
    store.health.clear(node)
    it = iter(zip(reply.fragments, buffers))
    for pos, status in zip(positions, reply.statuses):
        if status != FragmentStatus.OK:
            reads[pos].on_absent(node)
            continue
        meta_f, buf = next(it)
        header = FragmentHeader(meta_f.key, meta_f.index, meta_f.k, meta_f.m, meta_f.object_size, meta_f.payload_crc)
        reads[pos].on_fragment(node, Fragment(header, buf), meta_f.write_id)


def _decode(store, read: KeyRead) -> GetResult:
    try:  # the node checked every payload's crc before sending it
        return GetResult(read.key, GetStatus.HIT, store.codec.decode(read.fragments(), verify=False))
    except ErasureCodingError as exc:
        log.warning("store object %s: %s", read.key.hex(), exc)
        return GetResult(read.key, GetStatus.MISS)


def _touch_unasked(store, reads: dict[int, KeyRead], results) -> None:
    """Tell the group's nodes a read did not need that the object is in use (their LRU)."""
    node2keys: dict[str, list[bytes]] = defaultdict(list)
    for pos, read in reads.items():
        if results[pos] is not None and results[pos].is_hit and read.reserve:
            for node in read.reserve[: max(0, store.config.ec.num_fragments - len(read.first_wave))]:
                node2keys[node].append(read.key)
    for node, node_keys in node2keys.items():
        store.background(store.best_effort(node, TouchFragments(node_keys)))


def _finish_gets(store, results, keys) -> list[GetResult]:
    out: list[GetResult] = []
    num_late = 0
    for key, res in zip(keys, results):
        res = res or GetResult(key, GetStatus.DEADLINE)
        out.append(res)
        if res.is_hit:
            store.stats.num_hits += 1
            store.stats.num_bytes_read += len(res.data)
        elif res.status == GetStatus.DEADLINE:
            num_late += 1
        elif res.status == GetStatus.UNAVAILABLE:
            store.stats.num_unavailable += 1
        else:
            store.stats.num_misses += 1
    store.stats.num_gets += len(keys)
    store.stats.num_deadline_misses += num_late
    if num_late:  # debug: the engine's KV tiers say once when the store stops answering
        log.debug("store read: %d of %d objects missed the deadline; the engine recomputes them", num_late, len(keys))
    return out


def hint_short_reads(store, reads, results) -> None:
    """Objects read back while some of their group's nodes answered without a fragment (not
    stored, corrupt, expired): hint the node that gave the lowest index, the object's leader."""
    hints: dict[str, list[bytes]] = defaultdict(list)
    n = store.config.ec.num_fragments
    for pos, read in reads.items():
        if read.absent and results[pos] is not None and results[pos].is_hit and read.lowest_holder:
            if any(node in read.first_wave[:n] for node in read.absent) and store.note_hint(read.key):
                hints[read.lowest_holder].append(read.key)
    writes.send_hints(store, hints)
