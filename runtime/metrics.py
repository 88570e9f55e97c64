"""Prometheus metrics: one registry per process (or per component in tests), text exposition.

    metrics = MetricsRegistry()                      # or default_registry()
    requests = metrics.counter("requests_total", "Requests served", ["route"])
    requests.labels(route="/v1/completions").inc()
    metrics.histogram("handoff_seconds", "KV handoff latency").observe(0.012)
    body, content_type = metrics.exposition(), metrics.content_type   # for GET /metrics

Names get the ``deepinfer_`` prefix. Asking twice for the same name returns the same metric;
asking with a different kind or label set is an error naming the metric. Channel counters
(``transport.sockets.ChannelStats``) are exported without touching the hot path with
``track_channel`` (read at scrape time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from deepinfer.transport.sockets import ChannelStats

PREFIX = "deepinfer_"
# Seconds: 100 us .. 60 s, dense where RPCs, handoffs and engine steps live.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)


class MetricsRegistry:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, tuple[type, tuple[str, ...], Any]] = {}
        self._channels: dict[str, ChannelStats] = {}

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._get_or_create(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get_or_create(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._get_or_create(Histogram, name, doc, labels, buckets=tuple(buckets))

    def gauge_function(self, name: str, doc: str, read: Callable[[], float]) -> Gauge:
        """A gauge whose value is ``read()`` at scrape time (queue lengths, pool fill)."""
        gauge = self.gauge(name, doc)
        gauge.set_function(read)
        return gauge

    def track_channel(self, channel: str, stats: ChannelStats) -> None:
        """Export a channel's counters (messages in/out, drops by error code) at scrape time.
        Tracking a channel name again replaces the stats it points at."""
        if not self._channels:
            self.registry.register(_ChannelCollector(self._channels))
        self._channels[channel] = stats

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, for a /metrics endpoint."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of one sample (full sample name, e.g. ``x_total``), None if absent."""
        return self.registry.get_sample_value(PREFIX + name, labels or {})

    def _get_or_create(self, kind: type, name: str, doc: str, labels: Sequence[str], **kwargs):
        labels = tuple(labels)
        existing = self._metrics.get(name)
        if existing is not None:
            if existing[0] is not kind or existing[1] != labels:
                raise ValueError(f"metric {name!r} already exists as a {existing[0].__name__.lower()} with labels "
                                 f"{list(existing[1])}; asked for a {kind.__name__.lower()} with {list(labels)}")
            return existing[2]
        metric = kind(PREFIX + name, doc, labels, registry=self.registry, **kwargs)
        self._metrics[name] = (kind, labels, metric)
        return metric


class _ChannelCollector(Collector):
    def __init__(self, channels: dict[str, ChannelStats]):
        self._channels = channels

    def collect(self):
        for field, doc in (("num_received", "Messages received"), ("num_sent", "Messages sent"),
                           ("num_late_replies", "Replies that arrived after their caller gave up")):
            family = CounterMetricFamily(f"{PREFIX}channel_{field.removeprefix('num_')}", doc, labels=["channel"])
            for channel, stats in self._channels.items():
                family.add_metric([channel], getattr(stats, field))
            yield family
        dropped = CounterMetricFamily(f"{PREFIX}channel_dropped", "Frames dropped, by error code",
                                      labels=["channel", "code"])
        for channel, stats in self._channels.items():
            for code, count in stats.dropped_by_code.items():
                dropped.add_metric([channel, code.name], count)
        yield dropped


_default: MetricsRegistry | None = None


def default_registry() -> MetricsRegistry:
    """The process-wide registry that daemons expose on /metrics."""
    global _default
    if _default is None:
        _default = MetricsRegistry()
    return _default
