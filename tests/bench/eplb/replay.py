"""Replay a routing trace through re-placement policies and measure each step's imbalance.

Every policy sees the same steps through its own ``ExpertRebalancer`` (same window and period);
they differ in the planner and in whether drift can bring a plan forward (ours; the baseline keeps
DeepSeek's fixed period). A plan made after step t serves from step t + 1
(moving weights is not modelled). Loads follow ``placement``'s model: a replica carries its
expert's tokens over the replica count. Per step we keep ``sum_layers max_gpu`` and
``sum_layers mean_gpu``; any stretch's imbalance is the ratio of their sums over it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.parallel.eplb import EplbConfig, ExpertRebalancer, gpu_share, static_placement
from deepinfer_bench.eplb.dispatch_sim import least_loaded_peaks


@dataclass(slots=True)
class Series:
    peak: list[np.ndarray] = field(default_factory=list)  # per chunk: [n] sum over layers of max GPU load
    mean: list[np.ndarray] = field(default_factory=list)  # per chunk: [n] sum over layers of mean GPU load
    plan_seconds: float = 0.0
    num_plans: int = 0
    # with the least-loaded dispatch (dispatch_sim.py), for the policies asked for
    dispatch_peak: list[np.ndarray] = field(default_factory=list)
    dispatch_mean: list[np.ndarray] = field(default_factory=list)

    def imbalance(self, start: int = 0, end: int | None = None, dispatch: bool = False) -> float:
        peak, mean = (self.dispatch_peak, self.dispatch_mean) if dispatch else (self.peak, self.mean)
        peak, mean = np.concatenate(peak)[start:end], np.concatenate(mean)[start:end]
        return float(peak.sum() / mean.sum()) if mean.sum() > 0 else 1.0


def replay(chunks: Iterable[np.ndarray], config: EplbConfig, planners: dict, num_layers: int,
           num_logical: int, configs: dict | None = None, dispatch: tuple[str, ...] = ()) -> dict[str, Series]:
    """chunks: arrays [n, layers, num_logical]; planners: name -> planner, or None for the static
    placement that never changes; configs: name -> the EplbConfig of that policy where it is not
    ``config`` (the baseline's fixed schedule); dispatch: the policies also measured with the
    least-loaded dispatch. Returns name -> Series over every step of the trace."""
    configs = configs or {}
    static = static_placement(num_layers, num_logical, config.num_physical(num_logical), config.num_gpus)
    balancers = {name: ExpertRebalancer(configs.get(name, config), num_layers, num_logical, planner=p)
                 for name, p in planners.items() if p is not None}
    shares = {name: gpu_share(static, num_logical, config.num_gpus) for name in planners}
    placements = {name: static for name in planners}
    series = {name: Series() for name in planners}
    for chunk in chunks:
        chunk = np.asarray(chunk, dtype=np.float64)
        assert chunk.ndim == 3 and chunk.shape[1:] == (num_layers, num_logical), (
            f"trace steps must be [layers={num_layers}, experts={num_logical}], got {chunk.shape[1:]}")
        for name in planners:
            s = series[name]
            peak, mean = np.empty(chunk.shape[0]), np.empty(chunk.shape[0])
            start = 0
            balancer = balancers.get(name)
            for i in range(chunk.shape[0]) if balancer is not None else ():
                t0 = time.perf_counter()
                phy2log = balancer.observe(chunk[i])
                if phy2log is None:
                    continue
                s.plan_seconds += time.perf_counter() - t0
                s.num_plans += 1
                _measure(chunk[start : i + 1], shares[name], peak[start : i + 1], mean[start : i + 1])
                if name in dispatch:
                    _dispatched(s, chunk[start : i + 1], placements[name], config.num_gpus)
                shares[name] = gpu_share(phy2log, num_logical, config.num_gpus)
                placements[name] = phy2log
                start = i + 1
            _measure(chunk[start:], shares[name], peak[start:], mean[start:])
            if name in dispatch:
                _dispatched(s, chunk[start:], placements[name], config.num_gpus)
            s.peak.append(peak)
            s.mean.append(mean)
    return series


def _dispatched(series: Series, steps: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> None:
    peak, mean = least_loaded_peaks(steps, phy2log, num_gpus)
    series.dispatch_peak.append(peak)
    series.dispatch_mean.append(mean)


def _measure(steps: np.ndarray, share: np.ndarray, peak_out: np.ndarray, mean_out: np.ndarray) -> None:
    if steps.shape[0] == 0:
        return
    loads = np.einsum("tle,leg->tlg", steps, share)  # [n, layers, gpus]
    peak_out[:] = loads.max(axis=-1).sum(axis=-1)
    mean_out[:] = loads.mean(axis=-1).sum(axis=-1)
