from __future__ import annotations

import pytest

from deepinfer.cache.store.gc import (
    DAY_S,
    GcEntry,
    TtlPolicy,
    Watermarks,
    parse_duration_s,
    parse_ttl_spec,
    plan_gc,
)


def _entries(specs):
    """specs: (key, num_bytes, expires_at)"""
    return [GcEntry(*s) for s in specs]


def test_default_ttls_follow_the_spec():
    ttl = TtlPolicy()
    assert ttl.ttl_s("agent") == 3 * DAY_S
    assert ttl.ttl_s("chat") == 7 * DAY_S
    assert ttl.expires_at("agent", 1000.0) == 1000.0 + 3 * DAY_S
    assert ttl.ttl_s("unknown") == 7 * DAY_S


def test_nothing_to_do_below_the_high_watermark():
    wm = Watermarks(capacity_bytes=1000, high=0.9, low=0.5)
    lru = _entries([("a", 300, 1e9), ("b", 300, 1e9), ("c", 290, 1e9)])
    plan = plan_gc([], lru, used_bytes=890, watermarks=wm, now=0.0)
    assert plan.is_empty and plan.num_bytes_freed == 0


def test_lru_eviction_down_to_the_low_watermark_oldest_first():
    wm = Watermarks(capacity_bytes=1000, high=0.9, low=0.5)
    lru = _entries([("old", 200, 1e9), ("mid", 200, 1e9), ("new", 200, 1e9), ("newest", 350, 1e9)])
    plan = plan_gc([], lru, used_bytes=950, watermarks=wm, now=0.0)
    assert plan.evicted == ["old", "mid", "new"]  # 950 -> 750 -> 550 -> 350 <= 500
    assert plan.expired == [] and plan.num_bytes_freed == 600


def test_eviction_stops_exactly_at_low_mark():
    wm = Watermarks(capacity_bytes=1000, high=0.9, low=0.5)
    lru = _entries([(k, 100, 1e9) for k in "abcdefghij"])
    plan = plan_gc([], lru, used_bytes=1000, watermarks=wm, now=0.0)
    assert plan.evicted == list("abcde") and plan.num_bytes_freed == 500


def test_ttl_expiry_happens_whatever_the_fill_and_counts_toward_it():
    wm = Watermarks(capacity_bytes=1000, high=0.9, low=0.5)
    by_expiry = _entries([("agent1", 100, 10.0), ("agent2", 100, 20.0), ("chat1", 100, 50.0)])
    plan = plan_gc(by_expiry, [], used_bytes=300, watermarks=wm, now=20.0)
    assert plan.expired == ["agent1", "agent2"] and plan.evicted == []
    # expired bytes bring a full node under the high mark: no LRU eviction needed
    lru = _entries([("chat1", 100, 50.0), ("x", 800, 1e9)])
    plan = plan_gc(by_expiry, lru, used_bytes=950, watermarks=wm, now=20.0)
    assert plan.expired == ["agent1", "agent2"] and plan.evicted == []
    # an entry already expired is not evicted a second time
    tight = Watermarks(capacity_bytes=1000, high=0.8, low=0.5)
    plan = plan_gc(by_expiry, _entries([("agent1", 100, 10.0), ("x", 800, 1e9)]), 1000, tight, now=10.0)
    assert plan.expired == ["agent1"] and plan.evicted == ["x"]


def test_watermark_validation():
    with pytest.raises(ValueError, match="low <= high"):
        Watermarks(100, high=0.5, low=0.8)
    with pytest.raises(ValueError, match="capacity"):
        Watermarks(0)
    with pytest.raises(ValueError, match="positive"):
        TtlPolicy({"agent": 0})


def test_duration_and_ttl_spec_parsing():
    assert parse_duration_s("3d") == 3 * DAY_S
    assert parse_duration_s("12h") == 12 * 3600
    assert parse_duration_s("90") == 90
    with pytest.raises(ValueError, match="not a number"):
        parse_duration_s("three days")
    ttl = parse_ttl_spec("agent=1d, batch=2h,default=4d")
    assert ttl.ttl_s("agent") == DAY_S and ttl.ttl_s("batch") == 7200
    assert ttl.ttl_s("chat") == 7 * DAY_S  # kept from the defaults
    assert ttl.ttl_s("other") == 4 * DAY_S
    with pytest.raises(ValueError, match="CLASS=DURATION"):
        parse_ttl_spec("agent")
