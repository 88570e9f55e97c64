"""The write path of ClusterStore (client.py): encode, place, send, count durable fragments.

    object -> k+m fragments -> coding group = first k+m usable nodes of the key's ranking
                                (fewer when nodes are down: the trailing parity is not written,
                                 down to ``quorum`` nodes; below that the write fails at once)
           -> one PutFragments per node for the whole batch (split past MAX_REQUEST_BYTES)
           -> stored when >= quorum (default k+1) nodes acknowledged OK

A stored write short of k+m fragments is *degraded*: it counts in ``num_degraded_writes`` and its
key goes, as a RepairHint, to the node holding its lowest fragment index, whose repair (repair.py)
writes the missing fragments once nodes are there to hold them. Impossible writes say why: an
object whose fragments exceed what one node can take, a cluster that answered NO_SPACE.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import Sequence

from deepinfer.cache.store.api import PutResult, seconds_left
from deepinfer.cache.store.node import MAX_FRAGMENT_BYTES
from deepinfer.cache.store.placement import PlacementError
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import FragmentMeta, FragmentStatus, PutAck, PutFragments, RepairHint

MAX_REQUEST_BYTES = 64 * 1024 * 1024  # a batch to one node is split past this many payload bytes
_FRAGMENT_OVERHEAD = 4096  # pyeclib's header and padding, generously


async def put_objects(store, items: Sequence[tuple[bytes, object]], traffic_class: str, deadline: float) -> list[PutResult]:
    n, quorum = store.config.ec.num_fragments, store.config.quorum
    placed = await _encode_and_place(store, items)
    pos2statuses = await _send_puts(store, placed.node2batch, len(items), traffic_class, deadline)
    out, hints = [], defaultdict(list)
    for pos, (key, _) in enumerate(items):
        statuses = pos2statuses[pos]
        num_ok = statuses.count(FragmentStatus.OK)
        ok = not placed.errors[pos] and num_ok >= quorum
        message = placed.errors[pos] or ("" if ok else _shortfall(num_ok, n, quorum, statuses, placed.sizes[pos]))
        out.append(PutResult(key, ok, num_ok, message))
        if ok:
            store.stats.num_bytes_written += placed.sizes[pos]
        if ok and num_ok < n:
            store.stats.num_degraded_writes += 1
            hints[placed.pos2first[pos]].append(key)
    store.stats.num_puts += len(out)
    store.stats.num_put_failures += sum(not r.is_ok for r in out)
    if store.config.send_repair_hints:
        send_hints(store, hints)
    return out


def send_hints(store, node2keys: dict[str, list[bytes]]) -> None:
    for node, keys in node2keys.items():  # best effort: a lost hint is found by the holders' audit
        store.stats.num_repair_hints += len(keys)
        store.background(store.best_effort(node, RepairHint(keys)))


class _Placed:
    __slots__ = ("node2batch", "sizes", "errors", "pos2first")

    def __init__(self, num_items: int):
        self.node2batch: dict[str, list[tuple[int, FragmentMeta, bytes]]] = defaultdict(list)
        self.sizes = [0] * num_items
        self.errors = [""] * num_items
        self.pos2first = [""] * num_items  # node given the lowest fragment index (the repair hint goes there)


async def _encode_and_place(store, items) -> _Placed:
    ec, quorum = store.config.ec, store.config.quorum
    n = ec.num_fragments
    skip = store.health.write_skips(n)
    write_id = random.getrandbits(63)
    placed = _Placed(len(items))
    for pos, (key, data) in enumerate(items):
        try:
            size = _object_size(data)
            if size // ec.k + _FRAGMENT_OVERHEAD > MAX_FRAGMENT_BYTES:
                raise ValueError(f"object of {size} bytes is too large for the store: its fragments would be "
                                 f"{size // ec.k} bytes, over the {MAX_FRAGMENT_BYTES}-byte limit of a storage node "
                                 f"(objects up to about {ec.k * (MAX_FRAGMENT_BYTES - _FRAGMENT_OVERHEAD)} bytes at k={ec.k})")
            group = store.placement.coding_group(key, n, skip, min_width=quorum)
            fragments = store.codec.encode(key, data)
        except PlacementError as exc:
            placed.errors[pos] = f"{exc} (write quorum {quorum}); unusable: {_unusable(store, skip)}"
            continue
        except ValueError as exc:
            placed.errors[pos] = str(exc)
            continue
        placed.sizes[pos] = fragments[0].header.object_size
        placed.pos2first[pos] = group[0]
        for node, frag in zip(group, fragments):
            h = frag.header
            meta = FragmentMeta(h.key, h.index, h.k, h.m, h.object_size, h.payload_crc, write_id)
            placed.node2batch[node].append((pos, meta, frag.payload))
        if pos % 8 == 7:
            await asyncio.sleep(0)  # encoding holds the GIL: let other tasks run between objects
    return placed


def _object_size(data) -> int:
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    nbytes = getattr(data, "nbytes", None)  # memoryview, numpy, torch (via nbytes or numel)
    if nbytes is None and hasattr(data, "numel"):
        nbytes = data.numel() * data.element_size()
    return int(nbytes) if nbytes is not None else len(memoryview(data).cast("B"))


def _unusable(store, skip: set[str]) -> str:
    names = sorted(skip)
    return ", ".join(f"{n} {store.health.why(n)}" for n in names[:6]) + (", ..." if len(names) > 6 else "") or "none"


def _shortfall(num_ok: int, n: int, quorum: int, statuses: list[FragmentStatus | None], object_size: int) -> str:
    why = Counter("no answer" if s is None else s.name for s in statuses if s != FragmentStatus.OK)
    text = f"{num_ok} of {n} fragments stored, quorum {quorum}"
    if why:
        text += " (" + ", ".join(f"{count} {name}" for name, count in why.most_common()) + ")"
    if why.get("TOO_LARGE"):
        text += f": a fragment of this {object_size}-byte object is larger than a storage node's whole capacity"
    elif why.get("NO_SPACE"):
        text += ": storage nodes are full (the cluster needs capacity, or lower watermarks so GC frees room sooner)"
    return text


async def _send_puts(store, node2batch, num_items: int, traffic_class: str, deadline: float) -> list[list]:
    """One PutFragments per node (split past MAX_REQUEST_BYTES); per object, one status per
    fragment sent (None: the node did not answer)."""
    pos2statuses: list[list] = [[] for _ in range(num_items)]
    tasks: dict[asyncio.Task, tuple[str, list[int]]] = {}
    try:
        for node, batch in node2batch.items():
            for chunk in _chunks(batch, MAX_REQUEST_BYTES):
                msg = PutFragments(traffic_class, [meta for _, meta, _ in chunk])
                timeout_s = max(0.001, seconds_left(deadline))
                coro = store.client_of(node).request(msg, timeout_s=timeout_s, buffers=[p for _, _, p in chunk])
                tasks[store.request_task(node, coro)] = (node, [pos for pos, _, _ in chunk])
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, seconds_left(deadline)))
    finally:  # deadline or cancelled: stop waiting for the rest
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    for task, (node, positions) in tasks.items():
        reply = None if task.cancelled() or task.exception() is not None else task.result()
        if reply is None and not task.cancelled() and isinstance(task.exception(), TransportError):
            store.health.suspect(node)
        if isinstance(reply, PutAck) and len(reply.statuses) == len(positions):
            for pos, status in zip(positions, reply.statuses):
                pos2statuses[pos].append(status)
        else:
            for pos in positions:
                pos2statuses[pos].append(None)
    return pos2statuses


def _chunks(batch: list, max_bytes: int):
    chunk, size = [], 0
    for item in batch:
        if chunk and size + len(item[2]) > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item[2])
    if chunk:
        yield chunk
