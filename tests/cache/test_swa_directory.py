"""SWA directory (pure index + service) and cross-node slot fetch over the data plane."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deepinfer.cache.swa_directory import SwaDirectory, SwaDirectoryService
from deepinfer.cache.swa_fetch import SwaSlotFetcher, SwaSlotOwner
from deepinfer.cache.swa_state import RingSpec, SwaArena
from deepinfer.cache.swa_store import SlotLayout, SwaSlotStore
from deepinfer.transport.channels import EventPublisher
from deepinfer.transport.protocol import DownReason, PeerDown, PeerUp, Role, SwaSlotEvents


def ev(node, inst, saved=(), evicted=(), is_full=False):
    return SwaSlotEvents(node, inst, f"tcp://{node}:1", list(saved), [16 * (i + 1) for i in range(len(saved))],
                         list(evicted), is_full)


def test_directory_index_and_peer_down():
    d = SwaDirectory()
    d.apply(ev("a", 1, [b"k1", b"k2"]))
    d.apply(ev("b", 2, [b"k2"]))
    assert d.locate(b"k1").node_name == "a" and d.locate(b"k1").num_tokens == 16
    assert d.locate(b"k2", exclude="a").node_name == "b"
    assert d.locate(b"zz") is None
    d.apply(ev("a", 1, evicted=[b"k1"]))
    assert d.locate(b"k1") is None
    d.on_peer_event(PeerUp("b", Role.PREFILL, 2))  # ignored
    d.on_peer_event(PeerDown("b", Role.PREFILL, 2, DownReason.MISSED_BEATS))
    assert d.locate(b"k2", exclude="a") is None and d.locate(b"k2").node_name == "a"
    d.apply(ev("b", 2, [b"k9"]))  # a late event of the dead instance cannot resurrect it
    assert d.locate(b"k9") is None and d.nodes() == ["a"]
    d.check_integrity()


def test_directory_restart_and_full_set():
    d = SwaDirectory()
    d.apply(ev("a", 1, [b"k1", b"k2"]))
    d.apply(ev("a", 5, [b"k3"]))  # a restarted instance: its old slots are gone
    assert d.locate(b"k1") is None and d.locate(b"k3") is not None
    d.apply(ev("a", 5, [b"k4"]))
    d.apply(ev("a", 5, [b"k4"], is_full=True))  # full set: k3 was evicted without a message
    assert d.locate(b"k3") is None and d.locate(b"k4") is not None and d.num_keys == 1
    # PeerDown of an older instance does not drop the newer one
    d.on_peer_event(PeerDown("a", Role.PREFILL, 1, DownReason.RESTARTED))
    assert d.locate(b"k4") is not None
    assert d.drop_node("a") == 1 and d.num_keys == 0
    d.check_integrity()
    with pytest.raises(ValueError, match="boundaries"):
        d.apply(SwaSlotEvents("x", 9, "", [b"k"], [], []))


def _store(num_slots=4, seed=0):
    specs = [RingSpec(0, "window", 18, 64), RingSpec(1, "window", 18, 64), RingSpec(1, "comp_kv", 10, 128)]
    arena = SwaArena(specs, num_slots=2, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for s in specs:
        arena.ring(s.layer, s.name).normal_(generator=g)
    return SwaSlotStore(SlotLayout(specs), num_slots), arena


async def _until(pred, timeout_s=5.0):
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_fetch_across_nodes_then_owner_gone(tmp_path):
    owner_store, arena = _store()
    local_store, _ = _store()
    rings = arena.read_slot(1)
    directory = SwaDirectoryService("tcp://127.0.0.1:*")
    pub = EventPublisher("tcp://127.0.0.1:*")
    owner = fetcher = None
    try:
        dir_address = await directory.start()
        await pub.start()
        owner = SwaSlotOwner(owner_store, node_name="owner", instance_id=7, fetch_address="tcp://127.0.0.1:*",
                             publisher=pub, publish_interval_s=0.02, resync_interval_s=0.2)
        await owner.start()
        directory.connect_owner(pub.address)
        fetcher = await SwaSlotFetcher(local_store, node_name="me", directory_address=dir_address,
                                       receive_address=f"ipc://{tmp_path}/swa-recv").start()
        owner_store.put(b"boundary-2", 32, rings)
        # the full set is re-sent every 0.2 s, so the directory converges despite PUB/SUB joins
        await _until(lambda: directory.directory.locate(b"boundary-2") is not None)

        miss = await fetcher.fetch([b"boundary-3"], deadline_s=5)
        assert not miss.is_hit and miss.reason == "none"
        hit = await fetcher.fetch([b"boundary-3", b"boundary-2"], deadline_s=5)
        assert hit.is_hit and hit.key == b"boundary-2" and hit.num_tokens == 32 and hit.node_name == "owner"
        got_local = local_store.read(b"boundary-2", torch.float32)
        got_owner = owner_store.read(b"boundary-2", torch.float32)
        assert got_local[0] == 32 and all(torch.equal(got_local[1][k], got_owner[1][k]) for k in rings)
        assert owner.num_served == 1

        # evictions reach the directory
        owner_store.remove(b"boundary-2")
        await _until(lambda: directory.directory.locate(b"boundary-2") is None)

        # the owner dies with a slot still listed: the fetch misses within its deadline (replay)
        owner_store.put(b"boundary-4", 64, rings)
        await _until(lambda: directory.directory.locate(b"boundary-4") is not None)
        await owner.close()
        owner = None
        dead = await fetcher.fetch([b"boundary-4"], deadline_s=0.5)
        assert not dead.is_hit and dead.reason == "deadline" and dead.seconds < 2
        directory.directory.on_peer_event(PeerDown("owner", Role.PREFILL, 7, DownReason.MISSED_BEATS))
        assert (await fetcher.fetch([b"boundary-4"], deadline_s=1)).reason == "none"
    finally:
        if owner is not None:
            await owner.close()
        if fetcher is not None:
            await fetcher.close()
        await pub.close()
        await directory.close()


def test_directory_drops_silent_nodes():
    d = SwaDirectory()
    d.apply(ev("a", 1, [b"k1"]), now=10.0)
    d.apply(ev("b", 2, [b"k2"]), now=10.0)
    d.apply(ev("a", 1, is_full=True, saved=[b"k1"]), now=14.0)  # a's periodic full set
    assert d.drop_silent(now=15.5, max_age_s=5.0) == ["b"]
    assert d.locate(b"k2") is None and d.locate(b"k1").node_name == "a"
    assert d.drop_silent(now=15.5, max_age_s=5.0) == []
    d.check_integrity()


@pytest.mark.timeout(60)
async def test_owner_pushes_events_to_the_directory_and_goes_silent():
    """An owner given only the directory's address sends its events as requests; a dead one is
    dropped once silent for node_ttl_s (no heartbeats)."""
    owner_store, arena = _store()
    rings = arena.read_slot(0)
    directory = SwaDirectoryService("tcp://127.0.0.1:*", node_ttl_s=0.6)
    owner = None
    try:
        dir_address = await directory.start()
        with pytest.raises(ValueError, match="exactly one of publisher= and directory_address="):
            SwaSlotOwner(owner_store, node_name="x", instance_id=1, fetch_address="tcp://127.0.0.1:*")
        owner = SwaSlotOwner(owner_store, node_name="pusher", instance_id=3, fetch_address="tcp://127.0.0.1:*",
                             directory_address=dir_address, publish_interval_s=0.02, resync_interval_s=0.2)
        await owner.start()
        owner_store.put(b"boundary-1", 16, rings)
        await _until(lambda: directory.directory.locate(b"boundary-1") is not None)
        assert directory.directory.locate(b"boundary-1").fetch_address == owner.fetch_address
        await asyncio.sleep(1.0)  # alive: its full sets keep it listed past the TTL
        assert directory.directory.nodes() == ["pusher"]
        await owner.close()
        owner = None
        await _until(lambda: directory.directory.locate(b"boundary-1") is None, timeout_s=5.0)
        assert directory.directory.nodes() == []
    finally:
        if owner is not None:
            await owner.close()
        await directory.close()
