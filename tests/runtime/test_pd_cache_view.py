"""The gateway's cache view (events -> prefix index + store presence, gaps -> snapshots) and the
routing policies over it, with fabricated events and loads."""

from __future__ import annotations

import pytest

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.runtime.balance import DecodeLoad, PrefillLoad
from deepinfer.runtime.balance.store_presence import StorePresence
from deepinfer.runtime.disagg.cache_view import CacheView
from deepinfer.runtime.disagg.routing import Routing
from deepinfer.transport.protocol import KvCacheEvents

BS = 4


def hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, root_hash("m"))
    return out


def events(node: str, instance: int, seq: int, *, stored=(), evicted=(), written=(), snapshot=False) -> KvCacheEvents:
    return KvCacheEvents(node, instance, seq, "m", BS, list(stored), list(evicted), list(written), snapshot)


PROMPT = list(range(1, 18))  # 4 full blocks + 1 token
H = hashes(PROMPT)


def test_events_feed_the_index_in_order_and_a_gap_asks_for_a_snapshot():
    view = CacheView()
    view.engine_up("p0", 7, index_id=0)
    assert view.stale_engines() == ["p0"]  # a new instance: what it holds is unknown until a snapshot
    view.on_events(events("p0", 7, 0, stored=H[:2], snapshot=True))
    assert view.stale_engines() == [] and view.index.match(H) == {0: 2}
    view.on_events(events("p0", 7, 1, stored=H[2:3]))
    assert view.index.match(H) == {0: 3}
    view.on_events(events("p0", 7, 3, stored=H[3:4], evicted=H[2:3]))  # seq 2 lost
    assert view.stale_engines() == ["p0"] and view.stats.num_gaps == 1
    view.on_events(events("p0", 7, 3, stored=H[:1], snapshot=True))  # the engine's cache now: block 0 only
    assert view.index.match(H) == {0: 1} and view.stale_engines() == []
    view.on_events(events("p0", 7, 2, stored=H))  # older than the snapshot: ignored
    assert view.index.match(H) == {0: 1}
    view.index.check_integrity()


def test_a_snapshot_older_than_applied_events_is_asked_again_and_a_load_report_ahead_marks_stale():
    view = CacheView()
    view.engine_up("p0", 7, index_id=0)
    view.on_events(events("p0", 7, 5, stored=H[:1]))
    view.on_events(events("p0", 7, 4, stored=H[:2], snapshot=True))
    assert view.stale_engines() == ["p0"]
    view.on_events(events("p0", 7, 5, stored=H[:1], snapshot=True))
    assert view.stale_engines() == []
    view.on_load_seq("p0", 7, 6)  # it published 6, we saw 5
    assert view.stale_engines() == ["p0"]


def test_other_instances_are_dropped_and_down_forgets_the_engine_but_not_the_store():
    view = CacheView()
    view.engine_up("p0", 7, index_id=0)
    view.engine_up("d0", 9, index_id=None)
    view.on_events(events("p0", 7, 0, stored=H, snapshot=True))
    view.on_events(events("p0", 8, 1, stored=H))  # a life the heartbeats have not confirmed
    assert view.stats.num_dropped == 1
    view.on_events(events("d0", 9, 1, stored=H, written=H[:3]))  # a decode engine: store writes only
    assert view.index.match(H) == {0: 4} and view.store.num_leading(H) == 3
    view.engine_up("p0", 8, index_id=0)  # restarted: starts empty
    assert view.index.match(H) == {}
    view.engine_down("d0")
    assert view.store.num_leading(H) == 3
    assert view.block_hashes(PROMPT) == H  # as the engines hash: model and block size from their events


def test_store_presence_is_bounded_oldest_first():
    store = StorePresence(max_blocks=3)
    store.on_written(H[:3])
    store.on_written(H[:1])  # refreshed
    store.on_written(H[3:4])
    assert store.num_leading(H) == 1 and len(store) == 3  # H[1] (oldest) forgotten
    with pytest.raises(ValueError):
        StorePresence(0)


def loads(*backlogs: float) -> list[PrefillLoad]:
    return [PrefillLoad(i, 0, b) for i, b in enumerate(backlogs)]


DECODES = [DecodeLoad(0, 0, 0), DecodeLoad(1, 0, 0)]


def view_with(device: dict[int, int], store_blocks: int) -> CacheView:
    view = CacheView()
    for engine, n in device.items():
        view.engine_up(f"p{engine}", 1, index_id=engine)
        view.on_events(events(f"p{engine}", 1, 0, stored=H[:n], snapshot=True))
    view.engine_up("d0", 1, index_id=None)
    view.on_events(events("d0", 1, 1, written=H[:store_blocks]))
    return view


def test_tiered_prefers_its_own_cache_to_the_store_and_trades_it_against_load():
    view = view_with({1: 2}, store_blocks=4)
    routing = Routing("tiered", view)
    info = routing.request_info("r", PROMPT)
    prefill, decode = routing.choose(info, loads(0.0, 0.0), DECODES, now=0.0)
    assert prefill.engine_id == 1 and prefill.num_cached_tokens == 16  # own 2 blocks + 2 from the store
    prefill, _ = routing.choose(info, loads(0.0, 5.0), DECODES, now=0.0)  # p1 busy: the store serves p0 as well
    assert prefill.engine_id == 0 and prefill.num_cached_tokens == 16
    assert routing.stats.num_routed == 2 and routing.stats.prefill2routed == {1: 1, 0: 1}


def test_affinity_only_and_round_robin():
    view = view_with({1: 2}, store_blocks=0)
    affinity = Routing("affinity-only", view)
    info = affinity.request_info("r", PROMPT)
    assert [affinity.choose(info, loads(0.0, 50.0), DECODES, 0.0)[0].engine_id for _ in range(3)] == [1, 1, 1]
    rr = Routing("round-robin", view)
    picks = [rr.choose(rr.request_info("r", PROMPT), loads(0.0, 0.0), DECODES, 0.0) for _ in range(4)]
    assert [p.engine_id for p, _ in picks] == [0, 1, 0, 1] and [d.engine_id for _, d in picks] == [0, 1, 0, 1]
    assert rr.request_info("r", PROMPT).block_hashes == []  # it never looks
    with pytest.raises(ValueError, match="routing policy 'random'"):
        Routing("random", view)


def test_load_differences_under_the_noise_band_do_not_outweigh_the_own_cache():
    from deepinfer.runtime.balance import PrefillRouterConfig

    view = view_with({1: 2}, store_blocks=4)  # the store serves p0 as much as p1's own cache + the store
    exact = Routing("tiered", view, PrefillRouterConfig(load_noise_s=0.0))
    noisy = Routing("tiered", view, PrefillRouterConfig(load_noise_s=0.25))
    info = exact.request_info("r", PROMPT)
    assert exact.choose(info, loads(0.0, 0.2), DECODES, 0.0)[0].engine_id == 0  # 0.2 s of backlog > a store read
    assert noisy.choose(info, loads(0.0, 0.2), DECODES, 0.0)[0].engine_id == 1  # within the noise: its own blocks
    assert noisy.choose(info, loads(0.0, 0.6), DECODES, 0.0)[0].engine_id == 0  # past it: load again
