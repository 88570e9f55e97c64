"""Prometheus collectors for the store, read at scrape time (nothing to keep in sync).

``StorageCollector``: a storage node's stats, labelled by node name: fragments, used/capacity/
watermark bytes, puts/gets/hits/misses, expirations, evictions, corrupt fragments, rejected
writes, bytes read/written, read/write GB/s. ``deepinfer storage --metrics-port PORT`` serves it
on ``GET /metrics``; under ``deepinfer node --role storage`` it joins the node's registry.

``StoreClientCollector``: an engine's store client counters (hits, misses, deadline misses that
fell back to recompute, unavailable reads, hedged reads, degraded writes, repair hints, bytes),
for the engine process's registry (engine/kv/tier_metrics.py yields them with the KV tiers').
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
    "num_repaired": ("deepinfer_storage_repaired_fragments", "counter", "fragments rebuilt (decoded) onto nodes lacking them"),
    "num_moved": ("deepinfer_storage_moved_fragments", "counter", "fragments moved to the node their group now ranks"),
    "num_dropped": ("deepinfer_storage_dropped_fragments", "counter", "surplus fragment copies deleted"),
    "num_repair_bytes": ("deepinfer_storage_repair_written_bytes", "counter", "payload bytes written by repair and moves"),
    "num_repair_failures": ("deepinfer_storage_repair_failures", "counter", "repairs that could not finish (retried)"),
    "num_under_replicated": ("deepinfer_storage_under_replicated_objects", "gauge", "objects known short of k+m fragments"),
    "num_audited": ("deepinfer_storage_audited_objects", "counter", "objects whose fragments the repair audit counted"),
    "audit_progress": ("deepinfer_storage_audit_progress", "gauge", "fraction of the current audit pass done"),
    "num_scrubbed": ("deepinfer_storage_scrubbed_fragments", "counter", "fragments whose checksums the scrub verified"),
    "num_scrub_errors": ("deepinfer_storage_scrub_errors", "counter", "corrupt or vanished fragments the scrub found"),
    "membership_epoch": ("deepinfer_storage_membership_epoch", "gauge", "membership record in use (-1: none, no repair)"),
    "num_admin_refused": ("deepinfer_storage_admin_refused", "counter", "admin messages refused (peer not trusted)"),
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


_CLIENT_FIELDS = {
    "num_gets": ("deepinfer_store_client_gets", "objects asked for"),
    "num_hits": ("deepinfer_store_client_hits", "objects read back"),
    "num_misses": ("deepinfer_store_client_misses", "objects not stored"),
    "num_deadline_misses": ("deepinfer_store_client_deadline_misses", "objects not read in time: recomputed"),
    "num_unavailable": ("deepinfer_store_client_unavailable", "objects whose nodes were down"),
    "num_hedged": ("deepinfer_store_client_hedged_reads", "reads that asked past the first k+1 nodes"),
    "num_puts": ("deepinfer_store_client_puts", "objects written"),
    "num_put_failures": ("deepinfer_store_client_put_failures", "object writes short of quorum"),
    "num_degraded_writes": ("deepinfer_store_client_degraded_writes", "objects stored with fewer than k+m fragments"),
    "num_repair_hints": ("deepinfer_store_client_repair_hints", "objects reported to storage nodes as short of fragments"),
    "num_bytes_read": ("deepinfer_store_client_read_bytes", "object bytes read"),
    "num_bytes_written": ("deepinfer_store_client_written_bytes", "object bytes written"),
}


class StoreClientCollector:
    def __init__(self, stats: object, client_name: str):
        self._stats = stats  # api.ClientStats, updated in place by the client
        self._name = client_name

    def collect(self):
        for field, (name, text) in _CLIENT_FIELDS.items():
            family = CounterMetricFamily(name, text, labels=["client"])
            family.add_metric([self._name], float(getattr(self._stats, field)))
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
