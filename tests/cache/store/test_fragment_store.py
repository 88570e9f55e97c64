from __future__ import annotations

import os
import random
import threading

import pytest

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.ec import ECConfig, ErasureCodec, FragmentHeader
from deepinfer.cache.store.fragment_store import FragmentStatus, FragmentStore
from deepinfer.cache.store.gc import DAY_S, TtlPolicy, Watermarks


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _fragment(key: bytes, size: int = 1000, seed: int = 0):
    frags = ErasureCodec(ECConfig(k=4, m=2)).encode(key, random.Random(seed).randbytes(size))
    return frags[1]


def _open(tmp_path, capacity=1 << 20, high=0.9, low=0.5, clock=None):
    return FragmentStore(tmp_path, Watermarks(capacity, high, low), clock=clock or FakeClock()).open()


def _put(store, key, size=1000, cls="chat", write_id=7):
    frag = _fragment(key, size)
    return store.put(frag.header, frag.payload, write_id=write_id, traffic_class=cls), frag


def test_put_get_round_trip_with_record(tmp_path):
    store = _open(tmp_path)
    status, frag = _put(store, b"k1", cls="agent")
    assert status == FragmentStatus.OK
    res = store.get(b"k1")
    assert res.status == FragmentStatus.OK
    assert bytes(res.payload) == frag.payload and res.record.header == frag.header
    assert res.record.write_id == 7 and res.record.traffic_class == "agent"
    assert res.record.expires_at == res.record.written_at + 3 * DAY_S
    assert store.get(b"nope").status == FragmentStatus.NOT_FOUND
    s = store.stats()
    assert (s.num_fragments, s.num_puts, s.num_hits, s.num_misses) == (1, 1, 1, 1)
    assert s.used_bytes > len(frag.payload)
    store.check_integrity()
    store.close()


def test_a_payload_that_does_not_match_its_checksum_is_refused(tmp_path):
    store = _open(tmp_path)
    frag = _fragment(b"k")
    bad = bytearray(frag.payload)
    bad[10] ^= 1
    assert store.put(frag.header, bytes(bad), write_id=1, traffic_class="chat") == FragmentStatus.INVALID
    assert store.stats().num_rejected == 1 and not store.contains(b"k")


@pytest.mark.parametrize("where", ["payload", "header", "truncate"])
def test_corruption_on_disk_is_detected_counted_and_never_served(tmp_path, where):
    store = _open(tmp_path)
    _put(store, b"victim")
    path = ff.fragment_path(tmp_path / "frags", b"victim")
    data = bytearray(path.read_bytes())
    if where == "payload":
        data[-5] ^= 0x40
    elif where == "header":
        data[20] ^= 0x01  # inside object_size
    else:
        data = data[:-100]
    path.write_bytes(bytes(data))
    assert store.get(b"victim").status == FragmentStatus.CORRUPT
    assert store.stats().num_corrupt == 1
    assert not path.exists() and not store.contains(b"victim")  # dropped: a rewrite can repair it
    assert store.get(b"victim").status == FragmentStatus.NOT_FOUND
    store.check_integrity()


def test_restart_reloads_index_and_adopts_files_the_index_missed(tmp_path):
    clock = FakeClock()
    store = _open(tmp_path, clock=clock)
    for i in range(5):
        clock.now += 1
        _put(store, b"k%d" % i)
    clock.now += 1
    store.get(b"k0")  # k0 becomes most recent
    store.close()
    # a fragment renamed into place whose index insert never happened (crash in between)
    orphan = _fragment(b"orphan")
    rec = ff.FragmentRecord(orphan.header, 3, "agent", clock.now, clock.now + 100)
    path = ff.fragment_path(tmp_path / "frags", b"orphan")
    path.parent.mkdir(parents=True, exist_ok=True)
    ff.write_new_file(path, ff.pack_prefix(rec, len(orphan.payload)), orphan.payload)
    # a half-written temp file from the crash
    (tmp_path / "tmp" / "junk.tmp").write_bytes(b"partial")

    again = _open(tmp_path, clock=clock)
    assert again.num_fragments == 6
    assert bytes(again.get(b"orphan").payload) == orphan.payload
    assert again.get(b"k3").status == FragmentStatus.OK
    assert again.keys_lru_first()[:4] == [b"k1", b"k2", b"k4", b"k0"]  # recency survived (k3, orphan read now)
    assert not any((tmp_path / "tmp").iterdir())
    again.check_integrity()
    again.close()


def test_index_rows_whose_file_vanished_are_dropped_on_open(tmp_path):
    store = _open(tmp_path)
    _put(store, b"a")
    _put(store, b"b")
    store.close()
    ff.fragment_path(tmp_path / "frags", b"a").unlink()
    again = _open(tmp_path)
    assert not again.contains(b"a") and again.contains(b"b")
    again.check_integrity()


def test_fill_past_high_watermark_evicts_lru_and_keeps_recently_read(tmp_path):
    clock = FakeClock()
    size = ff.FIXED.size + 4 + 2 + 4 + len(_fragment(b"k00").payload) + len("chat")
    store = _open(tmp_path, capacity=20 * size, high=0.9, low=0.5, clock=clock)
    for i in range(18):  # 18 of 20: at the high mark, not past it
        clock.now += 1
        assert _put(store, b"k%02d" % i)[0] == FragmentStatus.OK
    assert store.stats().num_evicted == 0
    for i in (0, 1, 2):
        clock.now += 1
        assert store.get(b"k%02d" % i).status == FragmentStatus.OK
    clock.now += 1
    _put(store, b"k18")  # 19 > 18 high mark: evict LRU down to 10
    assert store.run_gc().num_evicted == 0  # the put already ran it
    kept = set(store.keys_lru_first())
    assert {b"k00", b"k01", b"k02", b"k18"} <= kept
    assert not kept & {b"k%02d" % i for i in range(3, 12)}
    assert store.used_bytes <= store.watermarks.low_bytes
    assert store.stats().num_evicted == 9
    store.check_integrity()


def test_a_write_that_cannot_fit_is_refused(tmp_path):
    store = _open(tmp_path, capacity=500)
    status, _ = _put(store, b"big", size=4000)
    assert status == FragmentStatus.TOO_LARGE  # larger than the whole node: can never fit
    assert store.used_bytes == 0
    store.check_integrity()


def test_ttl_by_traffic_class_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    store = _open(tmp_path, clock=clock)
    _put(store, b"agent-obj", cls="agent")
    _put(store, b"chat-obj", cls="chat")
    clock.now += 3 * DAY_S - 1
    assert store.run_gc().num_expired == 0
    assert store.get(b"agent-obj").status == FragmentStatus.OK  # reading does not extend retention
    clock.now += 2
    assert store.get(b"agent-obj").status == FragmentStatus.EXPIRED  # never served even before GC
    clock.now += 4 * DAY_S - 2
    assert store.get(b"chat-obj").status == FragmentStatus.OK
    clock.now += 2
    assert store.run_gc().num_expired == 1
    assert store.num_fragments == 0
    assert store.stats().num_expired == 2
    store.check_integrity()


def test_rewrite_replaces_and_refreshes_retention(tmp_path):
    clock = FakeClock()
    store = FragmentStore(tmp_path, Watermarks(1 << 20), TtlPolicy({"agent": 100.0}), clock=clock).open()
    _put(store, b"k", cls="agent", write_id=1)
    clock.now += 90
    _put(store, b"k", cls="agent", write_id=2)
    clock.now += 20
    assert store.run_gc().num_expired == 0  # the old heap entry is stale, not acted on
    res = store.get(b"k")
    assert res.status == FragmentStatus.OK and res.record.write_id == 2
    clock.now += 81
    assert store.run_gc().num_expired == 1
    store.check_integrity()


def test_concurrent_puts_gets_and_gc_keep_accounts_straight(tmp_path):
    store = _open(tmp_path, capacity=30_000, high=0.8, low=0.4)
    frags = {b"c%03d" % i: _fragment(b"c%03d" % i, 2000, i) for i in range(60)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                key = rng.choice(list(frags))
                if rng.random() < 0.5:
                    f = frags[key]
                    store.put(f.header, f.payload, write_id=seed, traffic_class="chat")
                else:
                    res = store.get(key)
                    if res.status == FragmentStatus.OK:
                        assert bytes(res.payload) == frags[key].payload
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats().num_evicted > 0 and store.stats().num_corrupt == 0
    assert store.used_bytes <= store.watermarks.capacity_bytes
    store.check_integrity()


def test_scrub_finds_rot_and_vanished_files_and_remembers_them_for_repair(tmp_path):
    store = _open(tmp_path)
    for key in (b"a", b"b", b"c"):
        _put(store, key)
    assert store.scrub(b"a")[0] == FragmentStatus.OK and store.scrub(b"zz") == (None, 0)
    path = ff.fragment_path(tmp_path / "frags", b"b")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))
    ff.fragment_path(tmp_path / "frags", b"c").unlink()
    assert store.scrub(b"b")[0] == FragmentStatus.CORRUPT and not path.exists()
    assert store.scrub(b"c") == (FragmentStatus.NOT_FOUND, 0)
    assert sorted(store.take_lost()) == [b"b", b"c"] and store.take_lost() == []
    assert store.keys_lru_first() == [b"a"] and store.holding(b"a") is not None
    store.check_integrity()


def test_evicted_keys_are_remembered_until_written_again(tmp_path):
    store = _open(tmp_path, capacity=5000, high=0.8, low=0.5)
    for i in range(6):  # fragments of ~1 KB (k=4): the fifth passes the high watermark
        _put(store, b"k%d" % i, size=4000)
    evicted = [b"k%d" % i for i in range(6) if not store.contains(b"k%d" % i)]
    assert evicted and all(store.was_evicted(k) for k in evicted)
    _put(store, evicted[0], size=4000)
    assert not store.was_evicted(evicted[0])
