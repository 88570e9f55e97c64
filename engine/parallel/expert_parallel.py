"""Expert parallelism of one model on one rank: its EP layers, statistics, re-placement, rules.

``ExpertParallel(model, ep, settings)`` puts an ``ExpertParallelMoE`` in place of every decoder
layer's MoE (``layers[i].mlp``; V4 and V4.1 share the MoE class), keeping only this rank's slots.
The step loop then keeps one contract on every rank of the group, in lockstep:

    ep.begin_step()                      # between two steps: window, swaps, rule decisions
    model forward   or   ep.idle_step()  # a rank with nothing to run still serves its experts

``begin_step`` is where everything that needs the group's agreement happens, at the same step on
every rank: the previous step's counts go into the load window; a re-placement due by the
schedule starts in the background (``replacement.py``); layers staged on every rank swap in; every
``rule_period`` steps the replica rule of each layer is decided from the sampled loads
(eplb/replica_choice.py). Draft-model MoEs (DSpark stages, MTP) stay replicated.

A re-placement that fails (``ReplacementError``, reported to every rank at the same step) turns
re-placement off for the group, logged with its reason (``replacement_error``); the group serves
on with the placement in service. A failure of the group itself (a dead peer, a step's collective
timing out) is not this: it breaks the group (ep_runner.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.engine.parallel.eplb import ExpertLoadWindow, ReplacementSchedule, plan, static_placement
from deepinfer.engine.parallel.eplb.schedule import window_imbalance
from deepinfer.engine.parallel.eplb.replica_choice import RULE_NAMES, RuleChooser
from deepinfer.engine.parallel.ep_moe import EpStepState, ExpertParallelMoE
from deepinfer.engine.parallel.expert_slots import SparePool
from deepinfer.engine.parallel.group import EpGroup
from deepinfer.engine.parallel.layer_placement import LayerPlacement
from deepinfer.engine.parallel.planner_process import PlannerProcess
from deepinfer.engine.parallel.settings import EpSettings
from deepinfer.engine.parallel.replacement import Replacement, ReplacementError

log = logging.getLogger(__name__)


class ExpertParallel:
    def __init__(self, model: torch.nn.Module, ep: EpGroup, settings: EpSettings = EpSettings(),
                 phy2log: np.ndarray | None = None, planner: Callable[..., np.ndarray] | None = None):
        moes = [layer.mlp for layer in model.layers]
        first = moes[0].experts
        self.num_logical = num_logical = first.num_experts
        if num_logical % ep.size:
            raise ValueError(f"{num_logical} experts do not split evenly over {ep.size} EP ranks; "
                             "give an EP size that divides the expert count")
        if settings.background_cpus and max(settings.background_cpus) >= (os.cpu_count() or 1):
            # (the calling thread may itself be pinned elsewhere: the machine's CPUs are the bound)
            raise ValueError(f"EP background_cpus {list(settings.background_cpus)}: this machine has CPUs "
                             f"0 to {(os.cpu_count() or 1) - 1}")
        if planner is None:
            planner = plan
            if settings.plan_in_child and settings.period > 0 and ep.rank == 0:
                planner = PlannerProcess(nice=settings.background_nice, cpus=settings.background_cpus)
                planner.start()
        self.ep, self.settings, self.planner = ep, settings, planner
        self.num_physical = num_logical + ep.size * settings.redundant_per_rank
        if phy2log is None:
            phy2log = static_placement(len(moes), num_logical, self.num_physical, ep.size)
        phy2log = np.asarray(phy2log, dtype=np.int64)
        assert phy2log.shape == (len(moes), self.num_physical), (
            f"phy2log must be [{len(moes)}, {self.num_physical}], got {phy2log.shape}")
        if settings.replica_rule not in ("measured", *RULE_NAMES):
            raise ValueError(f"replica_rule {settings.replica_rule!r}: choose measured, even or least_loaded")
        self.state = EpStepState(len(moes), num_logical)
        if settings.replica_rule != "measured":
            self.state.rules[:] = RULE_NAMES.index(settings.replica_rule)
        self.layers: list[ExpertParallelMoE] = []
        for i, (layer, moe) in enumerate(zip(model.layers, moes)):
            ep_moe = ExpertParallelMoE(moe, i, ep, LayerPlacement.of(phy2log[i], num_logical, ep.size), self.state)
            layer.mlp = ep_moe  # the full expert tensors go with the old module
            self.layers.append(ep_moe)
        self.pool = SparePool(self.layers[0].slots.gate_up, self.layers[0].slots.down, settings.spare_buffers)
        self.window = ExpertLoadWindow(len(moes), num_logical, settings.window)
        self.schedule = ReplacementSchedule(settings.window, max(settings.period, 1), settings.drift_margin)
        self.rules = RuleChooser(len(moes))
        self._sampled_loads: list[np.ndarray] = []
        self.replacement: Replacement | None = None
        self.num_replacements = 0
        self.num_replacements_done = 0
        self.num_layers_swapped = 0
        self.replacement_error: str | None = None  # why re-placement was turned off (module docstring)
        self.num_steps = 0

    @property
    def phy2log(self) -> np.ndarray:
        """[layers, P] the placement in service."""
        return np.stack([layer.placement.phy2log for layer in self.layers])

    def begin_step(self) -> None:
        """Between two steps, on every rank of the group (see the module docstring)."""
        s, state = self.settings, self.state
        if self.num_steps > 0:
            self.window.record(state.counts)
            state.counts[:] = 0.0
            if state.sampled:
                self._sampled_loads.append(state.loads.copy())
        if self.replacement is not None:
            try:
                self.num_layers_swapped += self.replacement.swap_ready()
            except ReplacementError as exc:  # agreed by every rank: each turns re-placement off here
                self._replacement_failed(exc)
            else:
                if self.replacement.is_done:
                    self.replacement.join()
                    self.schedule.planned_imbalance = self.replacement.planned_imbalance
                    self.replacement = None
                    self.num_replacements_done += 1
        if (s.period > 0 and self.replacement_error is None and self.replacement is None and self.num_steps > 0
                and self._is_due()):
            self.start_replacement()
        if s.replica_rule == "measured" and self.num_steps > 0 and self.num_steps % s.rule_period == 0:
            self._decide_rules()
        state.sampled = self.num_steps % s.sample_every == 0
        self.num_steps += 1

    def stats(self) -> dict[str, float]:
        """Lifetime figures of the group as this rank counts them; every rank steps and re-places
        at the same boundaries, so they agree. Cheap (no collective, no lock): /metrics reads it.

        num_steps (forwards, idle ones included), num_replacements (started),
        num_replacements_done (every changed layer in service), num_layers_swapped,
        replacement_in_flight (0/1), replacement_off (1 once a failed re-placement turned it off),
        planned_imbalance (the group's window under the placement in service when it was planned:
        slowest rank / mean; 0 before the first)."""
        return {"num_steps": float(self.num_steps), "num_replacements": float(self.num_replacements),
                "num_replacements_done": float(self.num_replacements_done),
                "num_layers_swapped": float(self.num_layers_swapped),
                "replacement_in_flight": float(self.replacement is not None),
                "replacement_off": float(self.replacement_error is not None),
                "planned_imbalance": float(self.schedule.planned_imbalance)}  # fmt: skip

    def _is_due(self) -> bool:
        """The schedule's answer, the same on every rank: the period, or drift measured on the
        group's window (its sum over the home ranks) under the placement in service."""
        schedule, num_steps = self.schedule, self.window.num_steps
        if schedule.is_due(num_steps):
            return True
        if not schedule.checks_drift(num_steps):
            return False
        total = self.ep.agree_sum(torch.from_numpy(self.window.total())).numpy()
        drifted = schedule.has_drifted(window_imbalance(total, self.phy2log, self.ep.size))
        return bool(self.ep.agree_max(torch.tensor([int(drifted)])).item())

    def _replacement_failed(self, exc: ReplacementError) -> None:
        """A re-placement failed on some rank (a planner error, a background transfer that timed
        out): the layers it swapped in stay (each layer's weights and maps go together), the rest
        keep their placement, and the group serves on without re-placing (its spare buffers are
        gone, and a side group whose transfer broke is not trusted again). The step in progress and
        every request go on: balance is an optimisation, not a reason to fail work."""
        self.replacement_error = str(exc)
        # not joined: a staging thread may still wait on a side transfer until its timeout; it
        # ends by itself (the spare pool is closed, its replacement object dropped)
        self.replacement = None
        log.error("EP rank %d: %s; expert re-placement is off for this group until it restarts",
                  self.ep.rank, exc)

    def start_replacement(self) -> None:
        """Plan from the window now and re-place in the background (every rank, same step)."""
        assert self.replacement is None, "a re-placement is already in flight"
        self.schedule.planned(self.window.num_steps, float("inf"))  # no drift check until it is in service
        self.replacement = Replacement(self.ep, self.layers, self.pool, self.planner, self.num_logical,
                                       nice=self.settings.background_nice, duty=self.settings.background_duty,
                                       cpus=self.settings.background_cpus)
        history = self.window.history() if self.settings.use_history else None
        self.replacement.start(self.window.total(), history, self.phy2log)
        self.num_replacements += 1

    def idle_step(self) -> None:
        """A step with no tokens of this rank's own: take part in every layer's exchanges."""
        for layer in self.layers:
            layer.forward_idle()

    def _decide_rules(self) -> None:
        if self._sampled_loads:
            # each rank knows its own loads; a step's cost is the group's slowest rank
            peaks = self.ep.agree_max(torch.from_numpy(np.stack(self._sampled_loads)))
            for step in peaks.numpy():
                self.rules.record(step)
        self._sampled_loads.clear()
        self.state.rules[:] = self.rules.decide()

    def close(self) -> None:
        """Stop a re-placement in flight (its thread ends at its next wait)."""
        self.pool.close()
        if self.replacement is not None:
            self.replacement.join(timeout=5.0)
        if isinstance(self.planner, PlannerProcess):
            self.planner.close()
