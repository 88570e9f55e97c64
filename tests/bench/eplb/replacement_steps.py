"""Step times around expert re-placements in a real EP group (``deepinfer bench eplb --traces steps``).

Two rank processes over gloo (tests/engine/parallel/ep_rank.py) decode the tiny V4 (8 layers
WWCHCHCH, 16 experts top-4, 2 redundant slots per rank) for ``steps`` steps with a re-placement
every ``period`` steps (window ``window``): rank 0 plans in its planner child, every rank stages
the new slots in the background and the layers swap one per step boundary. Figures, from rank 0:

    median_step_ms            all decode steps of the re-placing runs
    replacement_max_over_median
                              the longest step from 3 steps before a re-placement's first swap to
                              1 after its last over the run's median step, worst over all
                              re-placements (the target: within 1.2x); ``..._typical_...``: the
                              median over re-placements
    quiet_max_over_median     the longest step of a stretch of as many steps away from any
                              re-placement, typical over all such stretches: the noise floor of
                              this machine in the same run (a loaded 2-core machine: 2-3x)
    swap_loop_ms_max          the step loop's own time at a swap (begin_step: the agreement, which
                              waits for the slower rank to reach the boundary, and the swap)
    swap_work_ms_max          of that, the swap itself (weights' pointers and the layer's maps)
    control_max_over_median   the control: the same statistic over the same steps of a run of the
                              same group and workload with no re-placement (period 0), run
                              alternately with the measured one (``rounds`` of each). On a loaded
                              shared machine the longest of a dozen steps is the machine's noise,
                              not the re-placement's; what re-placement adds is
                              ``replacement_max_over_median - control_max_over_median``
    replacement_mean_over_control, swap_step_mean_over_control
                              mean step while a re-placement is in flight (plan to last swap) and
                              mean step right after a swap, over the control's mean step
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RANK_SCRIPT = Path(__file__).resolve().parents[2] / "engine" / "parallel" / "ep_rank.py"


def measure(steps: int = 240, window: int = 20, period: int = 40, rounds: int = 2,
            timeout_s: float = 900) -> dict[str, float]:
    """``rounds`` pairs of runs in one pair of rank processes: re-placing, then the control."""
    if not RANK_SCRIPT.is_file():
        raise FileNotFoundError(f"the EP rank script {RANK_SCRIPT} is missing (a checkout without tests/engine?)")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    with tempfile.TemporaryDirectory(prefix="eplb-steps-") as out:
        cases = []
        for r in range(rounds):
            for name, every in ((f"steps{r}", period), (f"control{r}", 0)):
                cases.append(dict(name=name, model="v4", layers="WWCHCHCH", hash=2, groups=[[0, 1]],
                                  settings=dict(redundant_per_rank=2, window=window, period=every, drift_margin=0.0),
                                  workload=dict(lengths=[20] * 8, gens=[steps] * 8)))
        spec = dict(world=2, port=_free_port(), out=out, v41_dir=None, cases=cases)
        spec_file = Path(out) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(spec_file), str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"EP rank {r} exited with {p.returncode}: {logs[r][-2000:]}")
        import torch

        runs = [Run.of(torch.load(Path(out) / f"steps{r}.g0.r0.pt", weights_only=False),
                       torch.load(Path(out) / f"control{r}.g0.r0.pt", weights_only=False)) for r in range(rounds)]
    return figures(runs)


class Run:
    """One re-placing run and its control (rank 0's record, ms): step_ms[i] is step i (0: the
    prefill); swaps[i] the layers swapped at the boundary before step i; in_flight[i] whether a
    re-placement was in flight during step i."""

    def __init__(self, step_ms, swaps, begin_ms, in_flight, num_replacements, control_ms, swap_work_ms=0.0):
        n = min(len(step_ms), len(control_ms))
        self.step_ms, self.control_ms = np.asarray(step_ms[:n], float), np.asarray(control_ms[:n], float)
        self.swaps, self.begin_ms = np.asarray(swaps[:n]), np.asarray(begin_ms[:n], float)
        self.in_flight = np.asarray(in_flight[:n], bool)
        self.num_replacements = num_replacements
        self.swap_work_ms = swap_work_ms

    @classmethod
    def of(cls, result: dict, control: dict) -> "Run":
        ms = lambda xs: np.asarray(xs, float) * 1e3  # noqa: E731
        return cls(ms(result["step_s"]), result["swaps"], ms(result["begin_s"]), result["step_in_flight"],
                   result["num_replacements"], ms(control["step_s"]), 1e3 * result.get("swap_work_s", 0.0))

    def stretches(self) -> list[tuple[int, int]]:
        """[first, end) of each re-placement's stretch: 3 steps before its first swap to 1 after its
        last. A re-placement is a run of steps with one in flight; its swaps need not be at
        consecutive boundaries (a layer swaps when every rank has staged it)."""
        n, spans = len(self.step_ms), []
        flight = np.concatenate([[False], self.in_flight, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(flight))
        for first, end in zip(edges[::2], edges[1::2]):
            # the swap that ends a re-placement comes at the boundary of its last step in flight
            swapped = np.flatnonzero(self.swaps[first:min(n, end + 1)]) + first
            if swapped.size:
                spans.append((max(1, int(swapped[0]) - 3), min(n, int(swapped[-1]) + 2)))
        return spans


def figures(runs: list[Run]) -> dict[str, float]:
    near_max, control_max, quiet_max, near_median = [], [], [], []
    in_flight, control_all, swap_steps = [], [], []
    for run in runs:
        n = len(run.step_ms)
        decode = np.arange(n) >= 1
        median, control_median = np.median(run.step_ms[decode]), np.median(run.control_ms[decode])
        spans = run.stretches()
        near = np.zeros(n, dtype=bool)
        for a, b in spans:
            near[a:b] = True
            near_max.append(run.step_ms[a:b].max() / median)
            control_max.append(run.control_ms[a:b].max() / control_median)
        if spans:
            near_median.append(np.median(run.step_ms[near]) / median)
            # the noise floor inside this run: the longest of a quiet stretch of as many steps, typical
            k = max(1, int(near.sum()) // len(spans))
            quiet = run.step_ms[decode & ~near]
            if quiet.size >= k:
                quiet_max.append(np.median(np.lib.stride_tricks.sliding_window_view(quiet, k).max(axis=1)) / median)
        in_flight.append(run.step_ms[decode & run.in_flight])
        swap_steps.append(run.step_ms[decode & (run.swaps > 0)])
        control_all.append(run.control_ms[decode])
    control_mean = np.mean(np.concatenate(control_all))
    worst = lambda xs: float(max(xs)) if xs else 0.0  # noqa: E731
    flying, swapped = np.concatenate(in_flight), np.concatenate(swap_steps)
    return dict(
        median_step_ms=float(np.median(np.concatenate([r.step_ms[1:] for r in runs]))),
        replacement_max_over_median=worst(near_max),
        control_max_over_median=worst(control_max),
        replacement_typical_max_over_median=float(np.median(near_max)) if near_max else 0.0,
        control_typical_max_over_median=float(np.median(control_max)) if control_max else 0.0,
        quiet_max_over_median=float(np.median(quiet_max)) if quiet_max else 0.0,
        replacement_median_over_median=float(np.median(near_median)) if near_median else 0.0,
        replacement_mean_over_control=float(flying.mean() / control_mean) if flying.size else 0.0,
        swap_step_mean_over_control=float(swapped.mean() / control_mean) if swapped.size else 0.0,
        swap_loop_ms_max=float(max((r.begin_ms[r.swaps > 0].max() for r in runs if (r.swaps > 0).any()),
                                   default=0.0)),
        swap_work_ms_max=float(max(r.swap_work_ms for r in runs)),
        replacements=float(sum(r.num_replacements for r in runs)),
        swapped_layers=float(sum(r.swaps.sum() for r in runs)),
        rounds=float(len(runs)),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
