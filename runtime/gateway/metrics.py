"""Prometheus metrics of one gateway app, in its own ``MetricsRegistry`` (runtime/metrics.py).

Latencies are observed where the gateway sees the engine's deltas, as generation.py folds each
one into its choice: time to first token (from the HTTP request's arrival), inter-token latency
(gap between deltas spread over the tokens each one carries), end-to-end latency. Queue lengths,
running requests and the prefix-cache hit rate are read from ``EngineClient.stats()`` at scrape
time, so /metrics never goes stale.
"""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deepinfer.engine.api.protocol import EngineClient
from deepinfer.runtime.metrics import MetricsRegistry

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

_SWA_HELP = {
    "num_restored": "admissions that restored a stored slot (no replay)",
    "num_replayed_exact": "admissions with a prefix hit that replayed the window exactly",
    "num_replayed_bounded": "admissions with a prefix hit that replayed a bounded window",
    "num_replayed_tokens": "tokens recomputed by replays",
    "num_snapshots": "slot snapshots taken at block boundaries",
    "num_saved": "snapshots saved as slots (finish or preemption)",
    "num_fetched": "slots fetched from another engine",
    "num_fetch_misses": "prefetches for which no engine held a slot",
    "num_fetch_failures": "listed slots not fetched (dead owner, deadline): replayed",
}


_SPEC_HELP = {
    "num_steps": "engine steps that verified at least one draft",
    "num_proposals": "drafter proposals (one per request and step)",
    "num_drafted": "draft tokens proposed",
    "num_verified": "draft tokens sent to the target for verification",
    "num_accepted": "draft tokens the target accepted",
    "num_request_steps": "decode steps of a request (root token + 0..D drafts)",
    "draft_seconds": "device seconds spent in the drafter",
}
_EP_HELP = {  # counters (the rest are gauges): ExpertParallel.stats, EpEngineGroup.stats
    "num_steps": ("counter", "forwards of the EP group (idle ones included)"),
    "num_replacements": ("counter", "expert re-placements started"),
    "num_replacements_done": ("counter", "expert re-placements with every changed layer in service"),
    "num_layers_swapped": ("counter", "MoE layers swapped to a new placement"),
    "restarts": ("counter", "restarts of the EP group after a lost rank"),
    "replacement_in_flight": ("gauge", "1 while a re-placement stages in the background"),
    "replacement_off": ("gauge", "1 once a failed re-placement turned re-placement off (until a restart)"),
    "planned_imbalance": ("gauge", "slowest rank / mean over the load window, under the placement in service when planned"),
    "size": ("gauge", "ranks of the EP group"),
    "ranks": ("gauge", "rank processes of the EP group"),
    "broken": ("gauge", "1 when the EP group broke (a rank died or timed out)"),
}
# drafts per request: 0 .. a few thousand
SPEC_REQUEST_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class _EngineStatsCollector(Collector):
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a scrape must not fail because the engine is busy or gone
            log.exception("engine.stats() failed during a /metrics scrape")
            return
        yield GaugeMetricFamily("deepinfer_num_requests_running", "Requests the engine is generating for",
                                value=stats.num_running)
        yield GaugeMetricFamily("deepinfer_num_requests_waiting", "Requests queued in the engine",
                                value=stats.num_waiting)
        if stats.max_num_waiting is not None:
            yield GaugeMetricFamily("deepinfer_queue_capacity", "Largest engine queue before HTTP 429",
                                    value=stats.max_num_waiting)
        if stats.prefix_cache_hit_rate is not None:
            yield GaugeMetricFamily("deepinfer_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
                                    "prompt tokens looked up", value=stats.prefix_cache_hit_rate)
        if stats.kv_cache_usage is not None:
            yield GaugeMetricFamily("deepinfer_kv_cache_usage", "Fraction of KV-cache blocks in use",
                                    value=stats.kv_cache_usage)
        for name, value in (stats.swa_slots or {}).items():
            # num_restored -> deepinfer_swa_slots_restored_total, and so on (SwaSlotStats)
            yield CounterMetricFamily(f"deepinfer_swa_slots_{name.removeprefix('num_')}",
                                      f"SWA slots: {_SWA_HELP.get(name, name)}", value=value)
        for name, value in (stats.spec or {}).items():
            # num_accepted -> deepinfer_spec_accepted_total, draft_seconds -> deepinfer_spec_draft_seconds_total
            yield CounterMetricFamily(f"deepinfer_spec_{name.removeprefix('num_')}",
                                      f"DSpark: {_SPEC_HELP.get(name, name)}", value=value)
        for name, value in (stats.ep or {}).items():
            # num_replacements -> deepinfer_ep_replacements_total, planned_imbalance -> deepinfer_ep_planned_imbalance
            kind, doc = _EP_HELP.get(name, ("gauge", name))
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"deepinfer_ep_{name.removeprefix('num_')}", f"Expert parallelism: {doc}", value=value)


class GatewayMetrics:
    def __init__(self, engine: EngineClient):
        self.metrics = m = MetricsRegistry()  # names get the deepinfer_ prefix
        self.ttft = m.histogram("time_to_first_token_seconds", "Time from request arrival to first token",
                                buckets=TTFT_BUCKETS)
        self.itl = m.histogram("inter_token_latency_seconds", "Time between consecutive output tokens",
                               buckets=ITL_BUCKETS)
        self.e2e = m.histogram("e2e_request_latency_seconds", "Time from request arrival to last token",
                               buckets=E2E_BUCKETS)
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of finished requests")
        self.cached_prompt_tokens = m.counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache")
        self.generation_tokens = m.counter("generation_tokens", "Generated tokens")
        self.requests_finished = m.counter("requests_finished", "Engine requests by finish reason", ["finish_reason"])
        # DSpark, per finished request: its drafted / verified / accepted draft tokens
        self.spec_request = m.histogram("spec_request_tokens", "Draft tokens of a finished request, by stage "
                                        "(drafted, verified, accepted)", ["stage"], buckets=SPEC_REQUEST_BUCKETS)
        self.http_responses = m.counter("http_responses", "HTTP responses by status code", ["code"])
        self.in_flight = m.gauge("gateway_requests_in_flight", "Generation requests the gateway is serving")
        m.registry.register(_EngineStatsCollector(engine))
        # the engine's own collectors: KV tier and store counters of an in-process engine, routing
        # counters of a disaggregated gateway (``metric_collectors()``, optional on an EngineClient)
        for collector in getattr(engine, "metric_collectors", lambda: [])():
            m.registry.register(collector)

    def render(self) -> bytes:
        return self.metrics.exposition()

    @property
    def content_type(self) -> str:
        return self.metrics.content_type
