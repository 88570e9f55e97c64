"""Moving SWA slots between nodes: the owner's side (publish + serve) and the fetcher's side.

Owner (``SwaSlotOwner``): drains its store's save/evict events and publishes them as
``SwaSlotEvents`` on its event socket, or sends them to the directory as requests when it is
given the directory's address instead (deltas every ``publish_interval_s``, the full set every
``resync_interval_s``, and at once after a failed send so nothing lost stays lost); serves
``SwaFetch`` on a ROUTER: it pushes the packed slot over the bulk data plane to the requester's
receiver, then replies ``FOUND`` (the requester holds every byte by then) or ``NOT_FOUND`` /
``LAYOUT_MISMATCH``.

Fetcher (``SwaSlotFetcher``): ``await fetch(keys, deadline_s)`` asks the directory where the
slots of ``keys`` are (candidate boundaries, longest first), fetches the first one another node
holds and saves it into the local store. It never raises for a remote failure: a miss, a dead
owner or a deadline gives a ``FetchResult`` with ``is_hit = False`` and the caller replays
instead (ARCHITECTURE.md, "Caches"). Run it as an asyncio task so other work overlaps the transfer.

    fetcher                 directory              owner
      | SwaLocate(keys) ------> |                      |
      | <---- SwaLocations ---- |                      |
      | SwaFetch(key, id, reply_to) ------------------> |
      | <======== bulk [packed slot], meta=SwaSlotHeader |   (data plane)
      | <-------------------------------- SwaFetchReply |
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
import zmq.asyncio

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.swa_store import SlotEventKind, SwaSlotStore
from deepinfer.transport.channels import EventPublisher, Incoming, RequestClient, RequestServer
from deepinfer.transport.dataplane import BulkReceiver, BulkSender, BulkTransfer
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import (
    TOPIC_SWA,
    SwaDirectoryReply,
    SwaFetch,
    SwaFetchReply,
    SwaFetchReplyUnion,
    SwaFetchRequest,
    SwaFetchStatus,
    SwaLocate,
    SwaSlotEvents,
    SwaSlotHeader,
)

log = logging.getLogger(__name__)


class SwaSlotOwner:
    def __init__(self, store: SwaSlotStore, *, node_name: str, instance_id: int, fetch_address: str,
                 publisher: EventPublisher | None = None, directory_address: str | None = None,
                 ctx: zmq.asyncio.Context | None = None, publish_interval_s: float = 0.05,
                 resync_interval_s: float = 5.0, send_timeout_s: float = 10.0) -> None:
        """Events go to ``publisher`` (the directory subscribes) or, when it is None, to the
        directory at ``directory_address`` as requests; one of the two is required."""
        if (publisher is None) == (directory_address is None):
            raise ValueError("SwaSlotOwner needs exactly one of publisher= and directory_address=")
        self.store = store
        self.node_name = node_name
        self.instance_id = instance_id
        self._publisher = publisher
        self._directory = None if directory_address is None else RequestClient(
            directory_address, SwaDirectoryReply, ctx=ctx, name=f"{node_name}-swa-events")
        self._is_resync_due = False
        self._ctx = ctx
        self._server = RequestServer(fetch_address, SwaFetchRequest, self._handle, ctx=ctx, name=f"{node_name}-swa-fetch")
        self._senders: dict[str, BulkSender] = {}
        self._publish_interval_s = publish_interval_s
        self._resync_interval_s = resync_interval_s
        self._send_timeout_s = send_timeout_s
        self._task: asyncio.Task | None = None
        self.num_served = 0

    @property
    def fetch_address(self) -> str:
        return self._server.address

    async def start(self) -> str:
        address = await self._server.start()
        if self._directory is not None:
            await self._directory.start()
        self._task = asyncio.create_task(self._publish_loop(), name=f"{self.node_name}-swa-publish")
        return address

    async def publish_now(self, *, is_full: bool = False) -> None:
        """Publish the store's events since the last call (or its whole set when ``is_full``)."""
        events = self.store.drain_events()
        saved: dict[BlockHash, int] = {}
        evicted: set[BlockHash] = set()
        for ev in events:  # in order: a key saved then evicted within one batch ends evicted
            if ev.kind == SlotEventKind.SAVED:
                saved[ev.key] = ev.num_tokens
                evicted.discard(ev.key)
            else:
                saved.pop(ev.key, None)
                evicted.add(ev.key)
        if is_full:
            saved, evicted = dict(self.store.stored_boundaries()), set()
        elif not saved and not evicted:
            return
        msg = SwaSlotEvents(self.node_name, self.instance_id, self.fetch_address, list(saved), list(saved.values()),
                            sorted(evicted), is_full)
        if self._directory is None:
            await self._publisher.publish(TOPIC_SWA, msg)
            return
        try:
            await self._directory.request(msg, timeout_s=self._send_timeout_s)
        except TransportError:
            self._is_resync_due = True  # these events are lost: the next message is the full set
            raise

    async def _publish_loop(self) -> None:
        next_full = time.monotonic()
        is_failing = False
        while True:
            now = time.monotonic()
            is_full = now >= next_full or self._is_resync_due
            self._is_resync_due = False
            if is_full:
                next_full = now + self._resync_interval_s
            try:
                await self.publish_now(is_full=is_full)
                is_failing = False
            except TransportError as exc:
                if not is_failing:  # once per outage, not every interval
                    log.warning("%s: slot events not published (retrying): %s", self.node_name, exc)
                is_failing = True
            await asyncio.sleep(self._publish_interval_s)

    async def _handle(self, incoming: Incoming) -> SwaFetchReply:
        msg = incoming.msg
        assert isinstance(msg, SwaFetch)
        if msg.layout_fingerprint != self.store.layout.fingerprint:
            return SwaFetchReply(msg.fetch_id, SwaFetchStatus.LAYOUT_MISMATCH)
        got = self.store.packed_copy(msg.key)
        if got is None:
            return SwaFetchReply(msg.fetch_id, SwaFetchStatus.NOT_FOUND)
        num_tokens, packed = got
        sender = self._senders.get(msg.reply_to)
        if sender is None:
            sender = self._senders[msg.reply_to] = await BulkSender(msg.reply_to, ctx=self._ctx,
                                                                    name=f"{self.node_name}-swa-push").start()
        header = msgspec.msgpack.encode(SwaSlotHeader(msg.fetch_id, msg.key, num_tokens, self.store.layout.fingerprint))
        await sender.send([packed], meta=header, timeout_s=self._send_timeout_s)
        self.num_served += 1
        return SwaFetchReply(msg.fetch_id, SwaFetchStatus.FOUND, num_tokens, packed.numel())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._server.close()
        if self._directory is not None:
            await self._directory.close()
        for sender in self._senders.values():
            await sender.close()
        self._senders.clear()


@dataclass(frozen=True, slots=True)
class FetchResult:
    is_hit: bool
    key: BlockHash | None = None
    num_tokens: int = 0
    node_name: str = ""
    seconds: float = 0.0
    reason: str = ""  # why there is no slot: "none", "not found", "deadline", "error: ..."


class SwaSlotFetcher:
    def __init__(self, store: SwaSlotStore, *, node_name: str, directory_address: str, receive_address: str,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.store = store
        self.node_name = node_name
        self._ctx = ctx
        self._directory = RequestClient(directory_address, SwaDirectoryReply, ctx=ctx, name=f"{node_name}-swa-dir")
        self._receiver = BulkReceiver(receive_address, ctx=ctx, name=f"{node_name}-swa-recv")
        self._owners: dict[str, RequestClient] = {}
        self._waiting: dict[int, asyncio.Future[BulkTransfer]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._decoder = msgspec.msgpack.Decoder(SwaSlotHeader)
        self.num_fetched = self.num_failed = 0

    async def start(self) -> SwaSlotFetcher:
        await self._directory.start()
        await self._receiver.start()
        self._task = asyncio.create_task(self._route_transfers(), name=f"{self.node_name}-swa-route")
        return self

    async def _route_transfers(self) -> None:
        while True:
            transfer = await self._receiver.recv()
            try:
                header = self._decoder.decode(transfer.meta)
            except msgspec.DecodeError:
                transfer.release()
                continue
            future = self._waiting.get(header.fetch_id)
            if future is None or future.done():
                transfer.release()  # its fetch already gave up
            else:
                future.set_result(transfer)

    async def fetch(self, keys: Sequence[BlockHash], deadline_s: float) -> FetchResult:
        """Fetch the slot of the first of ``keys`` (longest boundary first) that another node
        holds into the local store, within ``deadline_s``."""
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                return await self._fetch(keys, t0)
        except TimeoutError:
            self.num_failed += 1
            return FetchResult(False, seconds=time.perf_counter() - t0, reason="deadline")
        except TransportError as exc:  # a dead owner or directory: replay instead
            self.num_failed += 1
            return FetchResult(False, seconds=time.perf_counter() - t0, reason=f"error: {exc}")

    async def _fetch(self, keys: Sequence[BlockHash], t0: float) -> FetchResult:
        if not keys:
            return FetchResult(False, reason="none")
        reply = await self._directory.request(SwaLocate(list(keys)))
        found = next(((k, loc) for k, loc in zip(keys, reply.locations) if loc is not None and loc.node_name != self.node_name), None)
        if found is None:
            return FetchResult(False, seconds=time.perf_counter() - t0, reason="none")
        key, loc = found
        fetch_id = next(self._ids)
        future = self._waiting[fetch_id] = asyncio.get_running_loop().create_future()
        try:
            owner = self._owners.get(loc.fetch_address)
            if owner is None:
                owner = self._owners[loc.fetch_address] = await RequestClient(
                    loc.fetch_address, SwaFetchReplyUnion, ctx=self._ctx, name=f"{self.node_name}-swa-owner").start()
            msg = SwaFetch(key, fetch_id, self._receiver.address, self.store.layout.fingerprint)
            answer = await owner.request(msg, timeout_s=3600)  # the caller's deadline bounds it
            if answer.status != SwaFetchStatus.FOUND:
                self.num_failed += 1
                return FetchResult(False, key, seconds=time.perf_counter() - t0, reason=answer.status.name.lower())
            transfer = await future  # the push completed before the reply was sent
            try:
                header = self._decoder.decode(transfer.meta)
                view = transfer.view(0)
                packed = view if isinstance(view, torch.Tensor) else torch.from_numpy(view)
                if not self.store.put_packed(key, header.num_tokens, packed):
                    return FetchResult(False, key, seconds=time.perf_counter() - t0, reason="store full")
            finally:
                transfer.release()
            self.num_fetched += 1
            return FetchResult(True, key, header.num_tokens, loc.node_name, time.perf_counter() - t0)
        finally:
            self._waiting.pop(fetch_id, None)
            if not future.done():
                future.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for client in self._owners.values():
            await client.close()
        await self._directory.close()
        await self._receiver.close()
