"""A storage node's repair process: make every object whole again, and put fragments where the
ranking says they belong. Runs in every daemon started with a membership file; no election.

    where keys come from                       what happens to a batch of keys
    -------------------------------------      ----------------------------------------------
    RepairHint (degraded writes, short reads)  HasFragments to the key's read window: who
    fragments this node lost (scrub, reads)      holds which index of which write
    retries of objects still short (backoff,   plan_repair (repair_plan.py): moves, rebuilds,
      due at once when a node comes back)        drops, each executed by its own node:
    the periodic audit of every held key for     - moves:    this node holds a fragment outside
      which this node holds an index <= m, or                the group: copy it over, delete it
      sits outside the key's group now           - rebuilds: this node is the leader: decode the
                                                             object (hedged read), encode, write
                                                             the missing indices
                                                 - drops:    surplus copies are deleted

The holders of indices 0..m audit an object (a recoverable one has at least one of them), so
m+1 nodes look at each object per pass; only the leader (the lowest index held) rebuilds.
Re-encoding must reproduce the CRCs of the fragments that exist, or nothing is written. Hints are
gathered for ``hint_delay_s`` and audited together; while fewer than k+m nodes can take fragments
a degraded write has nowhere to go, so it is parked until a node comes back. An object that some
group node's LRU GC evicted lately (HasFragments answers -2) is left alone: it is leaving the
cache, and writing it back would fight the GC of a full node. Repair traffic (bytes read to
decode + bytes written) goes through a token bucket and the audit through a keys/s budget, so
foreground reads keep the node; one batch runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deepinfer.cache.store.api import deadline_after
from deepinfer.cache.store.ec import ECConfig
from deepinfer.cache.store.fragment_file import FragmentRecord
from deepinfer.cache.store.membership import MembershipError, MembershipFile, NodeState
from deepinfer.cache.store.rate import TokenBucket
from deepinfer.cache.store.repair_plan import Holding, RepairPlan, plan_repair
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import FragmentIndex, FragmentMeta, FragmentStatus, HasFragments, PutAck, PutFragments, RepairHint

log = logging.getLogger(__name__)

MAX_HINTED = 100_000  # keys waiting for a look; older hints are dropped (the audit finds them)
EVICTED = -2  # FragmentIndex: the node's GC evicted the key lately


@dataclass(frozen=True, slots=True)
class RepairConfig:
    audit_interval_s: float = 60.0  # pause between two audit passes over the node's keys
    audit_keys_per_s: float = 2000.0
    batch_keys: int = 128
    repair_bytes_per_s: float = 200e6  # decode reads + rebuilt and moved writes
    retry_s: float = 1.0  # first look again at an object still short; doubles up to max_retry_s
    hint_delay_s: float = 0.2  # hints are gathered this long, then audited as one batch
    # an audited key written this recently is looked at once its write is this old: the write may
    # still be on its way to the other nodes, and rebuilding a fragment in flight is wasted work
    # (hinted keys are not delayed: a hint comes after its write ended)
    audit_min_age_s: float = 2.0
    max_retry_s: float = 30.0
    membership_poll_s: float = 1.0
    request_timeout_s: float = 5.0


@dataclass(slots=True)
class RepairStats:
    num_repaired: int = 0
    num_moved: int = 0
    num_dropped: int = 0
    num_repair_bytes: int = 0
    num_repair_failures: int = 0
    num_audited: int = 0


class Repairer:
    def __init__(self, name: str, store, run_io: Callable, membership_file: str | Path, config: RepairConfig = RepairConfig()):
        """``store``: the node's FragmentStore; ``run_io(fn, *args)``: awaitable on the node's I/O pool."""
        self.name = name
        self.store = store
        self._run_io = run_io
        self.config = config
        self.stats = RepairStats()
        self._file = MembershipFile(membership_file)
        self.peers = None  # a ClusterStore over the membership, once this node is in it
        self._hinted: OrderedDict[bytes, float] = OrderedDict()  # key -> when hinted
        self._retry: dict[bytes, tuple[float, float]] = {}  # key -> (due at, current back-off)
        self._young: dict[bytes, float] = {}  # audited keys too recently written: key -> due at
        self._pass: list[bytes] = []
        self._pass_pos = 0
        self._next_pass_at = 0.0
        self._last_unusable: set[str] = set()
        self._bytes = TokenBucket(config.repair_bytes_per_s, burst=config.repair_bytes_per_s / 4)  # 250 ms worth
        self._keys = TokenBucket(config.audit_keys_per_s, burst=config.batch_keys)
        self._warned_not_member = False

    @property
    def epoch(self) -> int:
        return self.peers.membership.epoch if self.peers is not None else -1

    @property
    def num_under_replicated(self) -> int:
        return len(self._retry)

    @property
    def audit_progress(self) -> float:
        return self._pass_pos / len(self._pass) if self._pass else 1.0

    def hint(self, keys: list[bytes]) -> int:
        now = time.monotonic()
        for key in keys:
            self._hinted[key] = now
            self._hinted.move_to_end(key)
        while len(self._hinted) > MAX_HINTED:
            self._hinted.popitem(last=False)
        return len(keys)

    async def close(self) -> None:
        if self.peers is not None:
            await self.peers.close()
            self.peers = None

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        last_poll = 0.0
        while True:
            if time.monotonic() - last_poll >= self.config.membership_poll_s:
                last_poll = time.monotonic()
                await self._refresh_membership()
            if self.peers is None:
                await asyncio.sleep(self.config.membership_poll_s)
                continue
            batch, urgent = await self._next_batch()
            if not batch:
                await asyncio.sleep(min(0.1, self.config.membership_poll_s))
                continue
            try:
                await self._repair(batch, urgent)
            except (TransportError, OSError) as exc:
                log.warning("%s: repair batch of %d keys failed: %s", self.name, len(batch), exc)
                self.stats.num_repair_failures += 1
                self._schedule_retry(batch)
            await self._keys.take(len(batch))

    async def _refresh_membership(self) -> None:
        record = self._file.poll()
        if record is None:
            return
        if record.state_of(self.name) in (None, NodeState.REMOVED):
            if not self._warned_not_member:
                log.warning("%s: not a member of %s (epoch %d): no repair", self.name, self._file.path, record.epoch)
                self._warned_not_member = True
            return
        try:
            if self.peers is None:
                from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig

                config = ClusterStoreConfig(ec=ECConfig(record.k, record.m), send_repair_hints=False)
                self.peers = await ClusterStore(record, config).start()
            else:
                await self.peers.apply_membership(record)
        except (ValueError, MembershipError) as exc:
            log.warning("%s: membership epoch %d unusable: %s", self.name, record.epoch, exc)
            return
        self._next_pass_at = 0.0  # a membership change: audit everything now
        log.info("%s: membership epoch %d, %d nodes", self.name, record.epoch, len(record.ranked_names))

    async def _next_batch(self) -> tuple[list[bytes], set[bytes]]:
        size = self.config.batch_keys
        now = time.monotonic()
        for key in self.store.take_lost():  # damaged or vanished here: find its leader
            self._hinted[key] = now - self.config.hint_delay_s
        unusable = self.peers.health.unusable()
        # a node came back: what waited for it is due now (also while another node is out: a
        # strict-subset test missed the return whenever a second node flapped at that moment, and
        # the waiting keys then sat out their full back-off)
        if self._last_unusable - unusable:
            self._retry = {k: (now, backoff) for k, (_, backoff) in self._retry.items()}
        self._last_unusable = unusable
        urgent = []
        # hints come one write batch at a time: gather them a moment, then audit them together
        oldest = next(iter(self._hinted.values()), now)
        is_due = len(self._hinted) >= size or oldest <= now - self.config.hint_delay_s
        while is_due and self._hinted and len(urgent) < size:
            urgent.append(self._hinted.popitem(last=False)[0])
        if urgent and self._num_placeable(unusable) < self.peers.config.ec.num_fragments:
            # degraded writes while nodes are missing: nowhere to rebuild onto until one comes back
            for key in urgent:
                self._retry[key] = (now + self.config.max_retry_s, self.config.max_retry_s)
            urgent = []
        batch = list(urgent)
        for key, (due, _) in list(self._retry.items()):
            if len(batch) >= size:
                break
            if due <= now and key not in urgent:
                batch.append(key)
        for key, due in list(self._young.items()):
            if len(batch) >= size:
                break
            if due <= now:
                del self._young[key]
                batch.append(key)
        if len(batch) < size:
            batch += await self._audit_keys(size - len(batch))
        return list(dict.fromkeys(batch)), set(urgent)

    async def _audit_keys(self, num: int) -> list[bytes]:
        """The next keys of the audit pass this node looks after (index <= m, or outside the group)."""
        if self._pass_pos >= len(self._pass):
            if time.monotonic() < self._next_pass_at:
                return []
            self._pass = await self._run_io(self.store.keys_lru_first)
            self._pass_pos = 0
            self._next_pass_at = time.monotonic() + self.config.audit_interval_s
        chunk = self._pass[self._pass_pos : self._pass_pos + num]
        self._pass_pos += len(chunk)
        held = await self._run_io(lambda: [(k, self.store.holding(k), self.store.write_age_s(k)) for k in chunk])
        m, now, keys = self.peers.config.ec.m, time.monotonic(), []
        for key, h, age in held:
            if h is None or not (h[0] <= m or self.name not in self._group(key)):
                continue
            if age is not None and age < self.config.audit_min_age_s and len(self._young) < MAX_HINTED:
                self._young.setdefault(key, now + self.config.audit_min_age_s - age)
            else:
                keys.append(key)
        return keys

    def _num_placeable(self, unusable: set[str]) -> int:
        peers = self.peers
        return len(set(peers.placement.node_names) - unusable - peers.draining)

    def _group(self, key: bytes) -> list[str]:
        peers = self.peers
        skip = peers.health.unusable() | peers.draining
        return peers.placement.read_order(key, skip)[: peers.config.ec.num_fragments]

    def _schedule_retry(self, keys) -> None:
        now = time.monotonic()
        for key in keys:
            _, backoff = self._retry.get(key, (0.0, self.config.retry_s / 2))
            backoff = min(2 * backoff, self.config.max_retry_s)
            self._retry[key] = (now + backoff, backoff)

    # ---- one batch ----------------------------------------------------------------------
    async def _repair(self, keys: list[bytes], urgent: set[bytes]) -> None:
        plans, silent = await self._plan(keys)
        self._schedule_retry(silent)
        moves, rebuilds, drops, forwards = defaultdict(list), [], [], defaultdict(list)
        for plan in plans:
            self.stats.num_audited += 1
            my_moves, my_rebuilds, is_drop = plan.actions_of(self.name)
            for index, _, target in my_moves:
                moves[target].append((plan, index))
            if my_rebuilds:
                rebuilds.append(plan)
            if is_drop:
                drops.append(plan.key)
            if plan.rebuilds and plan.leader != self.name and plan.key in urgent:
                forwards[plan.leader].append(plan.key)
            if plan.rebuilds or plan.moves:
                self._schedule_retry([plan.key])  # looked at again until an audit finds it whole
            elif plan.num_unplaced:  # nowhere to put the rest until a node comes back (which makes it due)
                self._retry[plan.key] = (time.monotonic() + self.config.max_retry_s, self.config.max_retry_s)
            else:
                self._retry.pop(plan.key, None)
        for leader, leader_keys in forwards.items():
            self.peers.background(self.peers.best_effort(leader, RepairHint(leader_keys)))
        for target, items in moves.items():
            await self._move(target, items)
        if rebuilds:
            await self._rebuild(rebuilds)
        for key in drops:
            self.stats.num_dropped += await self._run_io(self.store.delete, key)

    async def _plan(self, keys: list[bytes]) -> tuple[list[RepairPlan], list[bytes]]:
        peers, n = self.peers, self.peers.config.ec.num_fragments
        unusable, draining = peers.health.unusable(), peers.draining
        width = n + peers.config.num_spare_nodes + len(draining)
        key2window = {key: peers.placement.read_window(key, n, width, unusable, draining)[0] for key in keys}
        node2keys: dict[str, list[bytes]] = defaultdict(list)
        for key, window in key2window.items():
            for node in window:
                if node != self.name:
                    node2keys[node].append(key)
        names = list(node2keys)
        replies = await asyncio.gather(*(self._has(node, node2keys[node]) for node in names))
        node2answer = dict(zip(names, replies))
        local = await self._run_io(lambda: {k: self.store.holding(k) for k in keys})
        plans, silent = [], []
        for key, window in key2window.items():
            group = [node for node in window if node not in draining][:n]
            holdings, is_silent, is_evicted = {}, False, False
            for node in window:
                if node == self.name:
                    held = local[key]
                else:
                    answer = node2answer[node]
                    if answer is None:
                        is_silent |= node in group  # a group node we cannot see: plan nothing yet
                        continue
                    held = answer.get(key)
                if held is not None and held[0] == EVICTED:
                    is_evicted = True
                elif held is not None:
                    holdings[node] = Holding(*held)
            if is_evicted:  # GC on a full node made room from it: the object ages out, it is not lost
                self._retry.pop(key, None)
            elif is_silent:
                silent.append(key)
            else:
                plans.append(plan_repair(key, peers.config.ec.k, n, group, holdings))
        return plans, silent

    async def _has(self, node: str, keys: list[bytes]) -> dict[bytes, tuple[int, int, int]] | None:
        try:
            reply = await self.peers.request_task(
                node, self.peers.client_of(node).request(HasFragments(keys), timeout_s=self.config.request_timeout_s))
        except (TransportError, asyncio.CancelledError):
            return None
        if not isinstance(reply, FragmentIndex) or len(reply.indices) != len(keys):
            return None
        crcs = reply.payload_crcs or [0] * len(keys)
        return {k: (i, w, c) for k, i, w, c in zip(keys, reply.indices, reply.write_ids, crcs) if i >= 0 or i == EVICTED}

    async def _move(self, target: str, items: list[tuple[RepairPlan, int]]) -> None:
        """Copy this node's fragments to ``target``; delete each once the target stored it."""
        read = await self._run_io(lambda: [(plan, self.store.read_fragment(plan.key)) for plan, _ in items])
        sendable = [(plan, got) for plan, got in read if got is not None and got[0].write_id == plan.write_id]
        stored = await self._put(target, [(got[0], got[1]) for _, got in sendable])
        for (plan, _), ok in zip(sendable, stored):
            if ok:
                self.stats.num_moved += 1
                await self._run_io(self.store.delete, plan.key)

    async def _rebuild(self, plans: list[RepairPlan]) -> None:
        codec = self.peers.codec
        results = await self.peers.get_blocks([p.key for p in plans], deadline=deadline_after(self.config.request_timeout_s))
        records = await self._run_io(lambda: [self.store.record_of(p.key) for p in plans])
        node2items: dict[str, list] = defaultdict(list)
        for plan, res, record in zip(plans, results, records):
            if not res.is_hit or record is None:
                self.stats.num_repair_failures += 1
                continue
            await self._bytes.take(len(res.data))
            fragments = codec.encode(plan.key, res.data)
            if any(fragments[i].header.payload_crc != crc for i, crc in plan.index2crc.items() if crc):
                log.warning("%s: object %s re-encodes differently from its stored fragments; not repaired",
                            self.name, plan.key.hex())
                self.stats.num_repair_failures += 1
                continue
            for index, target in plan.rebuilds:
                frag = fragments[index]
                rebuilt = FragmentRecord(frag.header, plan.write_id, record.traffic_class, record.written_at, record.expires_at)
                node2items[target].append((rebuilt, frag.payload))
        for target, items in node2items.items():
            stored = await self._put(target, items)
            self.stats.num_repaired += sum(stored)
            if log.isEnabledFor(logging.DEBUG):
                for (record, _), ok in zip(items, stored):
                    log.debug("%s: rebuilt %s index %d on %s: %s", self.name, record.header.key.hex()[:12],
                              record.header.index, target, "stored" if ok else "not stored")

    async def _put(self, target: str, items: list) -> list[bool]:
        """PutFragments of (record, payload) items to ``target``, keeping each record's expiry."""
        if not items:
            return []
        for _, payload in items:
            await self._bytes.take(len(payload))
        by_class: dict[str, list[int]] = defaultdict(list)
        for i, (record, _) in enumerate(items):
            by_class[record.traffic_class].append(i)
        ok = [False] * len(items)
        for traffic_class, positions in by_class.items():
            metas = []
            for i in positions:
                h, rec = items[i][0].header, items[i][0]
                metas.append(FragmentMeta(h.key, h.index, h.k, h.m, h.object_size, h.payload_crc, rec.write_id, rec.expires_at))
            try:
                reply = await self.peers.request_task(target, self.peers.client_of(target).request(
                    PutFragments(traffic_class, metas), buffers=[items[i][1] for i in positions],
                    timeout_s=self.config.request_timeout_s))  # fmt: skip
            except (TransportError, asyncio.CancelledError):
                self.stats.num_repair_failures += 1
                continue
            if isinstance(reply, PutAck) and len(reply.statuses) == len(positions):
                for i, status in zip(positions, reply.statuses):
                    ok[i] = status == FragmentStatus.OK
                    if ok[i]:
                        self.stats.num_repair_bytes += len(items[i][1])
        return ok
