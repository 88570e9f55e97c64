"""Prometheus exposition of a storage node's stats (read at scrape time, nothing to keep in sync).

``deepinfer storage --metrics-port PORT`` serves ``GET /metrics`` with these families, labelled
by node name: fragments, used/capacity/watermark bytes, puts/gets/hits/misses, expirations,
evictions, corrupt fragments, rejected writes, bytes read/written, read/write GB/s.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# StorageStats field -> (metric name, kind, help)
_FIELDS = {
    "num_fragments": ("deepinfer_storage_fragments", "gauge", "fragments held"),
    "used_bytes": ("deepinfer_storage_used_bytes", "gauge", "bytes on disk, headers included"),
    "capacity_bytes": ("deepinfer_storage_capacity_bytes", "gauge", "bytes this node may hold"),
    "high_watermark_bytes": ("deepinfer_storage_high_watermark_bytes", "gauge", "GC starts past this"),
    "low_watermark_bytes": ("deepinfer_storage_low_watermark_bytes", "gauge", "GC evicts down to this"),
    "num_puts": ("deepinfer_storage_puts", "counter", "fragments stored"),
    "num_gets": ("deepinfer_storage_gets", "counter", "fragment reads"),
    "num_hits": ("deepinfer_storage_hits", "counter", "fragment reads served"),
    "num_misses": ("deepinfer_storage_misses", "counter", "fragment reads not served"),
    "num_expired": ("deepinfer_storage_expirations", "counter", "fragments deleted by TTL"),
    "num_evicted": ("deepinfer_storage_evictions", "counter", "fragments evicted by LRU GC"),
    "num_corrupt": ("deepinfer_storage_corrupt_fragments", "counter", "fragments that failed a checksum"),
    "num_rejected": ("deepinfer_storage_rejected_writes", "counter", "writes refused (invalid or no space)"),
    "num_bytes_written": ("deepinfer_storage_written_bytes", "counter", "payload bytes written"),
    "num_bytes_read": ("deepinfer_storage_read_bytes", "counter", "payload bytes served"),
    "read_GBps": ("deepinfer_storage_read_gbps", "gauge", "payload GB/s served, last seconds"),
    "write_GBps": ("deepinfer_storage_write_gbps", "gauge", "payload GB/s written, last seconds"),
}


class StorageCollector:
    def __init__(self, stats: Callable[[], object]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for field, (name, kind, text) in _FIELDS.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=["node"])
            family.add_metric([s.node_name], float(getattr(s, field)))
            yield family


def registry_for(stats: Callable[[], object]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StorageCollector(stats))
    return registry


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """Serve GET /metrics; returns the runner (``await runner.cleanup()`` to stop)."""

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
