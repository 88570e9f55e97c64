"""Prometheus collector for an engine's KV tiers, read at scrape time (nothing to keep in sync).

Counters from ``KVOffloadStats`` (store reads, deadline misses that fell back to recompute,
blocks loaded per tier, write-behind), gauges of the host tier, and the store client's own
counters (``deepinfer_store_client_*``: reads, hits, unavailable, hedged reads, degraded writes,
repair hints, bytes; cache/store/metrics.py), labelled by engine name; one registration puts
them all on the engine process's /metrics::

    registry.register(KVTierCollector(offload, "prefill-0"))
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.cache.store.api import ClientStats
from deepinfer.cache.store.metrics import StoreClientCollector

# KVOffloadStats field -> (metric name, help)
_COUNTERS = {
    "num_store_reads": ("deepinfer_kv_store_reads", "requests whose prefix lookup asked the store"),
    "num_store_blocks_asked": ("deepinfer_kv_store_blocks_asked", "blocks asked from the store"),
    "num_store_blocks_hit": ("deepinfer_kv_store_blocks_hit", "leading blocks the store returned"),
    "num_deadline_misses": ("deepinfer_kv_store_deadline_misses", "store reads past their deadline: recomputed"),
    "num_store_unavailable": ("deepinfer_kv_store_unavailable", "store reads with too few nodes up: recomputed"),
    "num_bad_payloads": ("deepinfer_kv_bad_payloads", "blocks whose bytes did not fit the KV layout"),
    "num_loaded_host": ("deepinfer_kv_loaded_host_blocks", "blocks loaded into the device from the host tier"),
    "num_loaded_store": ("deepinfer_kv_loaded_store_blocks", "blocks loaded into the device from the store"),
    "num_copied_out": ("deepinfer_kv_copied_out_blocks", "new blocks copied out for write-behind"),
    "num_written_store": ("deepinfer_kv_written_store_blocks", "blocks written behind to the store"),
    "num_store_write_failures": ("deepinfer_kv_store_write_failures", "blocks the store did not take"),
    "num_store_writes_dropped": ("deepinfer_kv_store_writes_dropped", "blocks not written: too many writes in flight"),
}

# HostTierStats field -> (metric name, kind, help)
_HOST = {
    "used_bytes": ("deepinfer_kv_host_used_bytes", "gauge", "bytes held by the host tier"),
    "capacity_bytes": ("deepinfer_kv_host_capacity_bytes", "gauge", "host tier capacity"),
    "num_blocks": ("deepinfer_kv_host_blocks", "gauge", "blocks held by the host tier"),
    "num_evictions": ("deepinfer_kv_host_evictions", "counter", "blocks evicted (LRU) from the host tier"),
}


class KVTierCollector:
    def __init__(self, offload, engine_name: str):
        self._offload = offload  # engine/kv_offload.py KVOffload
        self._name = engine_name

    def collect(self):
        stats = self._offload.stats
        for field, (name, text) in _COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["engine"])
            family.add_metric([self._name], float(getattr(stats, field)))
            yield family
        store_stats = getattr(self._offload.tiers.store, "stats", None)
        if isinstance(store_stats, ClientStats):  # the cluster or fs store's client counters
            yield from StoreClientCollector(store_stats, self._name).collect()
        host = self._offload.tiers.host_stats()
        if host is None:
            return
        for field, (name, kind, text) in _HOST.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=["engine"])
            family.add_metric([self._name], float(getattr(host, field)))
            yield family
