"""Handoff metrics of one engine: bytes, latency (p50/p99 over a recent window), GB/s, failures.

Exported to Prometheus through the node's registry and summarised in ``PdEngineStatus`` (the
engine RPC) so tests and ``deepinfer bench pd`` read the same numbers.
"""

from __future__ import annotations

from collections import Counter, deque

from deepinfer.runtime.metrics import MetricsRegistry


class FailureKind:
    """Why a handoff (or an attempt) failed: label values of ``pd_handoff_failures_total``."""

    PEER_DOWN = "peer_down"  # the other engine's instance died or restarted
    LEASE_EXPIRED = "lease_expired"
    TRANSFER = "transfer"  # the bulk transfer failed or timed out
    REFUSED = "refused"  # the decode engine refused the import (bad payload, stale instance)
    NO_ROOM = "no_room"  # the decode engine never found a slot/blocks before the deadline
    ABORTED = "aborted"  # the client or gateway aborted the request mid-handoff


def percentile(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class HandoffMetrics:
    def __init__(self, registry: MetricsRegistry | None = None, window: int = 1024):
        self.num_handoffs = 0
        self.num_bytes = 0
        self.transfer_seconds = 0.0  # bulk transfer only (for GB/s)
        self.failures: Counter[str] = Counter()
        self._latencies: deque[float] = deque(maxlen=window)
        self._bytes = self._count = self._latency = self._failures = None
        if registry is not None:
            self._bytes = registry.counter("pd_handoff_bytes_total", "KV bytes handed from prefill to decode")
            self._count = registry.counter("pd_handoffs_total", "Acknowledged prefill->decode handoffs")
            self._latency = registry.histogram("pd_handoff_seconds", "Export + transfer + import + ack, per handoff")
            self._failures = registry.counter("pd_handoff_failures_total", "Failed handoffs by kind", ["kind"])

    def observe(self, num_bytes: int, latency_s: float, transfer_s: float) -> None:
        self.num_handoffs += 1
        self.num_bytes += num_bytes
        self.transfer_seconds += transfer_s
        self._latencies.append(latency_s)
        if self._bytes is not None:
            self._bytes.inc(num_bytes)
            self._count.inc()
            self._latency.observe(latency_s)

    def fail(self, kind: str) -> None:
        self.failures[kind] += 1
        if self._failures is not None:
            self._failures.labels(kind=kind).inc()

    @property
    def latency_p50_s(self) -> float:
        return percentile(self._latencies, 0.5)

    @property
    def latency_p99_s(self) -> float:
        return percentile(self._latencies, 0.99)

    @property
    def GBps(self) -> float:
        return self.num_bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0
