"""When to re-place experts, and the policy that ties window, schedule and planner together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.parallel.eplb.load_window import ExpertLoadWindow
from deepinfer.engine.parallel.eplb.placement import check_placement, static_placement
from deepinfer.engine.parallel.eplb.planner import plan


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """One EP group's balancer settings (ARCHITECTURE.md, "Balancers" gives PREFILL and DECODE below)."""

    num_gpus: int
    redundant_per_gpu: int  # replica slots per GPU beyond the experts it owns
    window: int  # steps of statistics a plan is made from
    period: int  # steps between re-placements
    num_nodes: int = 1
    use_history: bool = True  # hand the window's per-step loads to the planner

    def num_physical(self, num_logical: int) -> int:
        return num_logical + self.num_gpus * self.redundant_per_gpu

    def validate(self, num_logical: int) -> None:
        if self.num_gpus < 1 or self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise ValueError(f"{self.num_gpus} GPUs do not split over {self.num_nodes} nodes; "
                             "give a GPU count that is a multiple of the node count")
        if num_logical % self.num_gpus:
            raise ValueError(f"{num_logical} experts do not split evenly over {self.num_gpus} GPUs; "
                             "give an EP size that divides the expert count")
        if self.redundant_per_gpu < 0 or self.window < 1 or self.period < 1:
            raise ValueError(f"redundant experts per GPU must be >= 0 (got {self.redundant_per_gpu}), window and "
                             f"period >= 1 step (got {self.window}, {self.period})")


PREFILL = dict(redundant_per_gpu=4, window=100, period=1000)
DECODE = dict(redundant_per_gpu=1, window=1000, period=10000)

# plan(load [layers, logical], num_physical, num_gpus, num_nodes, history=[T, layers, logical] | None,
#      current=phy2log [layers, num_physical]) -> phy2log
Planner = Callable[..., np.ndarray]


class ReplacementSchedule:
    """Plan once the window first fills, then every ``period`` steps after that.

        steps:  0 ........ window ........ window+period ........ window+2*period
        plans:               ^ 1st               ^ 2nd                  ^ 3rd
    """

    def __init__(self, window: int, period: int):
        assert window >= 1 and period >= 1
        self.window, self.period = window, period

    def is_due(self, num_steps: int) -> bool:
        """After ``num_steps`` steps have been recorded, is a plan due?"""
        return num_steps >= self.window and (num_steps - self.window) % self.period == 0


class ExpertRebalancer:
    """Feeds per-step counts to the window; when the schedule says so, returns a new placement.

    The planner is a parameter so the same loop drives any placement algorithm (the bench runs
    DeepSeek's next to ours through it).
    """

    def __init__(self, config: EplbConfig, num_layers: int, num_logical: int, planner: Planner = plan):
        config.validate(num_logical)
        self.config = config
        self.num_logical = num_logical
        self.num_physical = config.num_physical(num_logical)
        self.window = ExpertLoadWindow(num_layers, num_logical, config.window)
        self.schedule = ReplacementSchedule(config.window, config.period)
        self.planner = planner
        self.phy2log = static_placement(num_layers, num_logical, self.num_physical, config.num_gpus)
        self.num_plans = 0

    def observe(self, counts: np.ndarray) -> np.ndarray | None:
        """Record one step (counts: [layers, num_logical]); the new phy2log [layers,
        num_physical] when a re-placement is due, else None."""
        self.window.record(counts)
        if not self.schedule.is_due(self.window.num_steps):
            return None
        cfg = self.config
        history = self.window.history() if cfg.use_history else None
        phy2log = self.planner(self.window.total(), self.num_physical, cfg.num_gpus, cfg.num_nodes, history=history,
                               current=self.phy2log)
        check_placement(phy2log, self.num_logical, cfg.num_gpus)
        assert phy2log.shape == self.phy2log.shape, f"planner returned {phy2log.shape}, want {self.phy2log.shape}"
        self.phy2log = phy2log
        self.num_plans += 1
        return phy2log
