"""Expert-parallel settings as plain values (no torch): what an engine option or a flag carries.

``EpSettings``: the balancer and replica-rule knobs of one rank's ``ExpertParallel``.
``ExpertParallelSpec``: one rank's place in a group (``EngineOptions.expert_parallel``; the
launcher, runtime/ep/engine_group.py, gives every rank its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.parallel.eplb.schedule import DRIFT_MARGIN

REPLICA_RULES = ("measured", "even", "least_loaded")


class EpSettingsError(ValueError):
    """A bad expert-parallel setting; the message names it."""


@dataclass(frozen=True, slots=True)
class EpSettings:
    redundant_per_rank: int = 0  # replica slots per rank beyond the experts it owns
    window: int = 100  # steps of statistics per plan (ARCHITECTURE.md, "Balancers": prefill 100, decode 1000)
    period: int = 1000  # steps between re-placements (prefill 1000, decode 10,000); 0: never
    drift_margin: float = DRIFT_MARGIN  # re-place early on drift (eplb/schedule.py); 0: every period only
    use_history: bool = True  # give the planner the window's steps, not only their sum
    spare_buffers: int = 1  # layers staged ahead of their swap
    sample_every: int = 16  # steps between measurements of both replica rules
    rule_period: int = 256  # steps between replica rule decisions
    replica_rule: str = "measured"  # "measured" (decided every rule_period), "even" or "least_loaded"
    plan_in_child: bool = True  # rank 0 plans in a child process (planner_process.py), off the GIL
    # nice value of the staging thread and the planner child: on a shared CPU the step loop first
    # (19: they run on what the loop leaves idle; 0: as fast as the loop)
    background_nice: int = 19
    # the share of wall time the staging thread works: after each piece (a slot's copy, one
    # all-to-all, a layer's packing) of t seconds it pauses t * (1 / duty - 1). Staging then
    # takes 1 / duty times longer, and a step never overlaps more than that share of it (on a
    # CPU the copies compete with the step for memory bandwidth even on a core of their own)
    background_duty: float = 1.0
    # CPUs the staging thread, the planner child and the side group's threads run on (Linux
    # affinity; empty: inherited), e.g. cores the step loop's thread is not pinned to
    background_cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("window", "spare_buffers", "sample_every", "rule_period"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise EpSettingsError(f"EP {name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("redundant_per_rank", "period"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise EpSettingsError(f"EP {name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not (isinstance(self.background_nice, int) and 0 <= self.background_nice <= 19):
            raise EpSettingsError(f"EP background_nice must be an integer from 0 to 19, got {self.background_nice!r}")
        if not (isinstance(self.background_duty, (int, float)) and 0 < self.background_duty <= 1):
            raise EpSettingsError(f"EP background_duty must be in (0, 1], got {self.background_duty!r}")
        if not (isinstance(self.background_cpus, (tuple, list)) and
                all(isinstance(c, int) and c >= 0 for c in self.background_cpus)):
            raise EpSettingsError(f"EP background_cpus must be CPU numbers >= 0, got {self.background_cpus!r}")
        object.__setattr__(self, "background_cpus", tuple(self.background_cpus))  # a JSON list arrives as a list
        if not self.drift_margin >= 0:
            raise EpSettingsError(f"EP drift_margin must be >= 0, got {self.drift_margin!r}")
        if self.replica_rule not in REPLICA_RULES:
            raise EpSettingsError(f"EP replica_rule {self.replica_rule!r}: choose one of {', '.join(REPLICA_RULES)}")


@dataclass(frozen=True, slots=True)
class ExpertParallelSpec:
    rank: int
    size: int
    init_method: str  # tcp://HOST:PORT where the group meets (rank 0 listens)
    settings: EpSettings = field(default_factory=EpSettings)
    timeout_s: float = 30.0  # a collective waiting longer for a peer fails the group

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and
                0 <= self.rank < self.size):
            raise EpSettingsError(f"EP rank {self.rank!r} of size {self.size!r}: need 0 <= rank < size")
        if not (isinstance(self.init_method, str) and self.init_method.startswith("tcp://")):
            raise EpSettingsError(f"EP init_method must be tcp://HOST:PORT, got {self.init_method!r}")
        if not self.timeout_s > 0:
            raise EpSettingsError(f"EP timeout_s must be > 0 seconds, got {self.timeout_s!r}")


def build_ep_runner(runner, spec: ExpertParallelSpec):
    """Join the group and shard ``runner``'s model: the runner an EP rank's engine core is given
    (engine/core/factory.py calls this when ``EngineOptions.expert_parallel`` is set)."""
    from deepinfer.engine.parallel.ep_runner import EpRunner
    from deepinfer.engine.parallel.expert_parallel import ExpertParallel
    from deepinfer.engine.parallel.group import EpGroup

    ep = EpGroup.init(spec.rank, spec.size, spec.init_method, device=runner.device, timeout_s=spec.timeout_s,
                      side_cpus=spec.settings.background_cpus)
    return EpRunner(runner, ExpertParallel(runner.model, ep, spec.settings), timeout_s=spec.timeout_s, owns_group=True)
