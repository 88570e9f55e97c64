"""Run several policies on one trace (in worker processes when asked) and collect their results."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from deepinfer_bench.sim.cluster import ClusterConfig, Simulation, Sizing, size_pools
from deepinfer_bench.sim.metrics import PolicyResult
from deepinfer_bench.sim.policies import build_policy
from deepinfer_bench.sim.workload import Trace, WorkloadConfig, generate_trace, ideal_prefill_seconds


@dataclass(frozen=True, slots=True)
class TraceSummary:
    num_sessions: int
    num_agent_sessions: int
    session_rate: float
    ideal_prefill_load: float  # ideal-reuse prefill demand of sessions started / pool capacity
    decode_max_requests: int
    nominal_decode_concurrency: float
    ve_token_ms: float


def build(workload: WorkloadConfig, cluster: ClusterConfig, seed: int) -> tuple[Trace, Sizing, TraceSummary]:
    trace = generate_trace(workload, cluster.num_prefill, cluster.prefill_cost, seed)
    sizing = size_pools(trace, cluster)
    demand = sum(ideal_prefill_seconds(s, workload.block_size, cluster.prefill_cost) for s in trace.sessions)
    summary = TraceSummary(
        num_sessions=len(trace.sessions),
        num_agent_sessions=sum(s.is_agent for s in trace.sessions),
        session_rate=trace.session_rate,
        ideal_prefill_load=demand / (workload.duration_s * cluster.num_prefill),
        decode_max_requests=sizing.decode_max_requests,
        nominal_decode_concurrency=sizing.nominal_decode_concurrency,
        ve_token_ms=sizing.ve_token_s * 1e3,
    )
    return trace, sizing, summary


# The trace a forked worker inherits from its parent (set just before the pool starts); under
# the spawn start method it is missing and the worker rebuilds it from the seed (same result).
_inherited: dict[tuple, tuple[Trace, Sizing]] = {}


def _run_one(args) -> PolicyResult:
    workload, cluster, seed, name = args
    key = (workload, cluster, seed)
    if key not in _inherited:
        trace, sizing, _ = build(workload, cluster, seed)
        _inherited[key] = (trace, sizing)
    trace, sizing = _inherited[key]
    return _simulate(trace, cluster, sizing, name)


def _simulate(trace: Trace, cluster: ClusterConfig, sizing: Sizing, name: str) -> PolicyResult:
    return Simulation(trace, cluster, name, sizing).run()


def run_policies(workload: WorkloadConfig, cluster: ClusterConfig, seed: int, names: list[str],
                 num_jobs: int = 0) -> tuple[TraceSummary, list[PolicyResult]]:
    """Every policy replays the same trace (same seed, same sessions). ``num_jobs`` worker
    processes (0: one per CPU, at most one per policy); results are identical either way."""
    for name in names:  # fail on a bad name before any work starts
        build_policy(name, cluster.prefill_cost, cluster.decode_cost, 1)
    trace, sizing, summary = build(workload, cluster, seed)
    num_jobs = min(len(names), num_jobs or os.cpu_count() or 1)
    if num_jobs <= 1:
        return summary, [_simulate(trace, cluster, sizing, name) for name in names]
    _inherited[(workload, cluster, seed)] = (trace, sizing)
    try:
        with ProcessPoolExecutor(max_workers=num_jobs) as pool:
            results = list(pool.map(_run_one, [(workload, cluster, seed, name) for name in names]))
    finally:
        _inherited.clear()
    return summary, results
