"""Metrics registry: per-process registries, get-or-create, exposition text, channel counters."""

import logging

import pytest

from deepinfer.runtime.metrics import MetricsRegistry, default_registry
from deepinfer.transport.errors import MalformedFrame, OversizedFrame
from deepinfer.transport.sockets import ChannelStats


def test_counters_gauges_histograms_show_up_in_the_exposition():
    metrics = MetricsRegistry()
    requests = metrics.counter("requests", "Requests served", ["route"])
    requests.labels(route="/v1/completions").inc(3)
    assert metrics.counter("requests", "Requests served", ["route"]) is requests  # get-or-create
    metrics.gauge("queue_depth", "Waiting requests").set(7)
    latency = metrics.histogram("handoff_seconds", "KV handoff latency", buckets=(0.01, 0.1, 1.0))
    for seconds in (0.005, 0.05, 0.5, 5.0):
        latency.observe(seconds)
    depth = [4]
    metrics.gauge_function("pool_free", "Free blocks", lambda: depth[0])
    depth[0] = 9
    text = metrics.exposition().decode()
    assert 'deepinfer_requests_total{route="/v1/completions"} 3.0' in text
    assert "deepinfer_queue_depth 7.0" in text
    assert 'deepinfer_handoff_seconds_bucket{le="0.1"} 2.0' in text
    assert 'deepinfer_handoff_seconds_bucket{le="+Inf"} 4.0' in text
    assert "deepinfer_handoff_seconds_count 4.0" in text
    assert "deepinfer_pool_free 9.0" in text  # read at scrape time
    assert metrics.value("requests_total", {"route": "/v1/completions"}) == 3.0
    assert metrics.value("absent_total") is None
    assert metrics.content_type.startswith("text/plain")


def test_registries_are_independent_and_conflicts_name_the_metric():
    a, b = MetricsRegistry(), MetricsRegistry()
    a.counter("x", "x").inc()
    b.counter("x", "x").inc(5)
    assert (a.value("x_total"), b.value("x_total")) == (1.0, 5.0)
    with pytest.raises(ValueError, match="metric 'x' already exists as a counter with labels \\[\\]"):
        a.gauge("x", "x")
    with pytest.raises(ValueError, match="asked for a counter with \\['route'\\]"):
        a.counter("x", "x", ["route"])
    assert default_registry() is default_registry()


def test_channel_stats_are_exported_at_scrape_time():
    metrics = MetricsRegistry()
    stats = ChannelStats()
    metrics.track_channel("n0-control", stats)
    metrics.track_channel("n0-bulk", ChannelStats(num_received=2))
    stats.num_received = 10
    stats.num_sent = 9
    quiet = logging.getLogger("test-quiet")
    stats.record_drop(MalformedFrame("bad"), quiet, "n0-control")
    stats.record_drop(OversizedFrame("big"), quiet, "n0-control")
    stats.record_drop(OversizedFrame("big"), quiet, "n0-control")
    assert metrics.value("channel_received_total", {"channel": "n0-control"}) == 10
    assert metrics.value("channel_received_total", {"channel": "n0-bulk"}) == 2
    assert metrics.value("channel_sent_total", {"channel": "n0-control"}) == 9
    assert metrics.value("channel_dropped_total", {"channel": "n0-control", "code": "OVERSIZED"}) == 2
    assert metrics.value("channel_dropped_total", {"channel": "n0-control", "code": "MALFORMED"}) == 1
