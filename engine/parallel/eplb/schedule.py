"""When to re-place experts, and the policy that ties window, schedule and planner together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.parallel.eplb.load_window import ExpertLoadWindow
from deepinfer.engine.parallel.eplb.placement import check_placement, gpu_loads, gpu_share, imbalance, static_placement
from deepinfer.engine.parallel.eplb.planner import plan


DRIFT_MARGIN = 0.02  # on the bench's synthetic traces: decode 1.078 -> 1.059 (9 plans instead of 2 in 21,000 steps)


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """One EP group's balancer settings (ARCHITECTURE.md, "Balancers" gives PREFILL and DECODE below)."""

    num_gpus: int
    redundant_per_gpu: int  # replica slots per GPU beyond the experts it owns
    window: int  # steps of statistics a plan is made from
    period: int  # steps between re-placements
    num_nodes: int = 1
    use_history: bool = True  # hand the window's per-step loads to the planner
    # re-place early when the window's imbalance under the placement in service has grown this
    # much over what the plan left (0: only every period, DeepSeek's schedule); see ReplacementSchedule
    drift_margin: float = DRIFT_MARGIN

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
        if not self.drift_margin >= 0:
            raise ValueError(f"drift_margin must be >= 0 (got {self.drift_margin}); 0 re-places only every period")


# prefill re-places early at under half decode's margin: a 2 s step makes a plan (about 3 s here) and
# its weight moves cheap next to the 100 steps between drift checks. On the bench's synthetic prefill
# EP4 traces (seeds 0 / 1 / 2 / 3, the planner's smoothed step cost throughout): 0.0075 gives
# 1.0466 / 1.0490 / 1.0497 / 1.0463 with 22 / 26 / 28 / 23 plans in 3100 steps, 0.005 1.0500 on
# seed 2, 0.01 1.0482 / 1.0497 / 1.0500 / 1.0465 with 14 / 15 / 20 / 12 plans, 0.015
# 1.0483 / 1.0502 / 1.0512, 0.03 1.0496 / 1.0506 / 1.0538 (5 plans on seed 2)
PREFILL_DRIFT_MARGIN = 0.0075
PREFILL = dict(redundant_per_gpu=4, window=100, period=1000, drift_margin=PREFILL_DRIFT_MARGIN)
DECODE = dict(redundant_per_gpu=1, window=1000, period=10000)

# plan(load [layers, logical], num_physical, num_gpus, num_nodes, history=[T, layers, logical] | None,
#      current=phy2log [layers, num_physical]) -> phy2log
Planner = Callable[..., np.ndarray]


class ReplacementSchedule:
    """Plan once the window first fills, then ``period`` steps after the last plan, and early
    when the load has drifted away from the placement:

        steps:  0 ........ window ........ window+period ........ window+2*period
        plans:               ^ 1st               ^ 2nd                  ^ 3rd      (no drift)

    Drift: every ``window`` steps after a plan, the window's total load is measured under the
    placement in service (slowest GPU over the mean, summed over layers; ``window_imbalance``).
    When it exceeds what the plan left on its own window by more than ``drift_margin``, a plan is
    due at once. Decode's steady stream drifts (a topic's share moves, a burst starts) over a
    10,000-step period: on the bench's synthetic decode trace the imbalance climbs from 1.055
    after a plan to 1.14 before the next, and a burst can push it to 1.9; a re-placement that
    does not stall the loop (engine/parallel/replacement.py) is cheap enough to run when needed.
    """

    def __init__(self, window: int, period: int, drift_margin: float = 0.0):
        assert window >= 1 and period >= 1 and drift_margin >= 0
        self.window, self.period, self.drift_margin = window, period, drift_margin
        self.last_plan: int | None = None  # num_steps at the last plan
        self.planned_imbalance = 0.0  # the window's imbalance under the plan made then

    def is_due(self, num_steps: int) -> bool:
        """After ``num_steps`` steps have been recorded, is a periodic plan due?"""
        if self.last_plan is None:
            return num_steps >= self.window
        return num_steps - self.last_plan >= self.period

    def checks_drift(self, num_steps: int) -> bool:
        """Is this a step to measure drift at (every window steps after a plan)?"""
        if not self.drift_margin or self.last_plan is None:
            return False
        since = num_steps - self.last_plan
        return since >= self.window and since % self.window == 0

    def has_drifted(self, imbalance_now: float) -> bool:
        return imbalance_now > self.planned_imbalance + self.drift_margin

    def planned(self, num_steps: int, imbalance: float) -> None:
        """A plan was made after ``num_steps`` steps, leaving ``imbalance`` on its window."""
        self.last_plan, self.planned_imbalance = num_steps, imbalance


def window_imbalance(total: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> float:
    """Slowest GPU over the mean of a window's total load [layers, E] under a placement."""
    return imbalance(gpu_loads(total, gpu_share(phy2log, total.shape[1], num_gpus)))


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
        self.schedule = ReplacementSchedule(config.window, config.period, config.drift_margin)
        self.planner = planner
        self.phy2log = static_placement(num_layers, num_logical, self.num_physical, config.num_gpus)
        self.num_plans = 0

    def observe(self, counts: np.ndarray) -> np.ndarray | None:
        """Record one step (counts: [layers, num_logical]); the new phy2log [layers,
        num_physical] when a re-placement is due, else None."""
        self.window.record(counts)
        cfg, schedule, num_steps = self.config, self.schedule, self.window.num_steps
        due = schedule.is_due(num_steps)
        if not due and schedule.checks_drift(num_steps):
            due = schedule.has_drifted(window_imbalance(self.window.total(), self.phy2log, cfg.num_gpus))
        if not due:
            return None
        total = self.window.total()
        history = self.window.history() if cfg.use_history else None
        phy2log = self.planner(total, self.num_physical, cfg.num_gpus, cfg.num_nodes, history=history,
                               current=self.phy2log)
        check_placement(phy2log, self.num_logical, cfg.num_gpus)
        assert phy2log.shape == self.phy2log.shape, f"planner returned {phy2log.shape}, want {self.phy2log.shape}"
        self.phy2log = phy2log
        self.num_plans += 1
        schedule.planned(num_steps, window_imbalance(total, phy2log, cfg.num_gpus))
        return phy2log
