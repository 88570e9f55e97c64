"""Step times around expert re-placements in a real EP group (``deepinfer bench eplb --traces steps``).

Two rank processes over gloo (this file run as a script, one per rank) decode a V4 of the tiny
model's shape (8 layers WWCHCHCH, 16 experts top-4, 2 redundant slots per rank) widened so that a
step is compute, not scheduler noise: hidden ``hidden`` and expert width ``intermediate``
(default 1024 / 512, ``seqs`` 64 sequences: about 0.14 s a step, 6 MB of weights per expert slot). The
prompts have staggered lengths (20 to 83 tokens), as a served batch has: with equal lengths every
sequence would close its compressed entries at the same steps, and those steps would be the
longest ones whether or not anything is re-placed. Each rank is pinned to a core of its own
(``pin``), plus a second one for its background staging where the machine has 4 cores or more
and a third for the planner child where it has 6 or more
(a GPU rank stages through its copy engines, not its step's own SMs), each core on a physical
core of its own where there are enough (``rank_cores``): the step loop's thread on the first, the
staging thread and the planner child on the others (``EpSettings.background_cpus``), the staging
working ``duty`` of the wall time (``EpSettings.background_duty``). A run decodes ``steps`` steps with a re-placement
every ``period`` steps (window ``window``): rank 0 plans in its planner child, every rank stages
the new slots in the background and the layers swap at step boundaries. Each re-placing run is
followed, in the same processes, by a control run of the same workload with no re-placement
(period 0); ``rounds`` pairs. Figures, from rank 0 (a step: from one step boundary to the next,
the boundary's agreement and swaps included):

    median_step_ms            all decode steps of the re-placing runs
    replacement_max_over_median
                              the longest step from 3 steps before a re-placement starts (the
                              window's snapshot, then the plan, the staging and the swaps) to 1
                              after its last swap, over the run's median step: worst over all
                              re-placements (the target: within 1.2x); ``..._typical_...``: the
                              median over re-placements
    control_max_over_median   the same statistic over the same steps of the control run, over the
                              control's median: the machine's own noise in the same run. What
                              re-placement adds is the difference; ``excess_max``: the largest
                              difference of one stretch
    quiet_max_over_median     the longest step of a stretch of as many steps away from any
                              re-placement, typical over all such stretches
    replacement_mean_over_control, swap_step_mean_over_control
                              mean step while a re-placement is in flight (plan to last swap) and
                              mean step right after a swap, over the control's mean step
    <phase>_step_mean_over_control
                              mean step of the steps that overlapped the background's ``phase``
                              (plan, copy, send, pack: replacement.Replacement.timeline) over the
                              control's mean step; ``..._same_steps``: over the control's mean of
                              the same steps (the workload's own slow steps cancel)
    gc_step_ms_max            the most cyclic-GC time inside one step (gc.callbacks), any run;
                              with ``freeze_gc`` (default) the model's objects are frozen out of
                              the collector after each run's setup, as
                              engine/core/step_loop.tune_interpreter(freeze_gc=True) does
    swap_loop_ms_max          the step loop's own time at a swap (begin_step: the agreement, which
                              waits for the slower rank to reach the boundary, and the swap)
    swap_work_ms_max          of that, the swap itself (weights' pointers and the layer's maps)
    stage_layer_ms_median     the background's time to stage one layer (copy + send + pack)
    worst_step_over_control_step, worst_step_in_<phase>
                              the longest step of any stretch over the control's same step, and
                              whether it overlapped each background phase (1 or 0)
    worst_step_cpu_over_control_cpu, worst_step_page_faults
                              that step's step-loop thread CPU time over the control's same step's
                              (about 1: it waited, on a peer, the GIL or a shared core; more: it
                              computed more), and the rank process's minor page faults in it
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HARNESS_DIR = Path(__file__).resolve().parents[2] / "engine" / "parallel"  # ep_harness: prompts, lockstep loop
PHASES = ("plan", "copy", "send", "pack")
LAYERS, NUM_HASH = "WWCHCHCH", 2


def measure(steps: int = 240, window: int = 20, period: int = 80, rounds: int = 2, hidden: int = 1024,
            intermediate: int = 512, seqs: int = 64, pin: bool = True, duty: float = 1.0, freeze_gc: bool = True,
            timeout_s: float = 1800, records_path: str | None = None) -> dict[str, float]:
    """``rounds`` pairs of runs in one pair of rank processes: re-placing, then the control.
    ``records_path``: also write the raw records there for a closer look at single steps (JSON:
    rank 0's every step's start time, the swaps, the background phases' timeline; the same of
    rank 1 under ``"rank1"``: a lockstep step is as slow as its slower rank)."""
    if not (HARNESS_DIR / "ep_harness.py").is_file():
        raise FileNotFoundError(f"the EP test harness {HARNESS_DIR / 'ep_harness.py'} is missing "
                                "(a checkout without tests/engine?)")
    if rounds < 1 or steps < 2 * period:
        raise ValueError(f"need rounds >= 1 and steps >= 2 * period, got rounds {rounds}, steps {steps}, "
                         f"period {period}")
    with tempfile.TemporaryDirectory(prefix="eplb-steps-") as out:
        spec = dict(world=2, port=_free_port(), out=out, steps=steps, window=window, period=period, rounds=rounds,
                    hidden=hidden, intermediate=intermediate, seqs=seqs, pin=pin, duty=duty, freeze_gc=freeze_gc)
        spec_file = Path(out) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, str(spec_file), str(r)], env=env,
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
        records = json.loads((Path(out) / "rank0.json").read_text())
        if records_path is not None:
            other = json.loads((Path(out) / "rank1.json").read_text())
            Path(records_path).write_text(json.dumps({**records, "rank1": other}))
    runs = [Run.of(records[f"steps{r}"], records[f"control{r}"]) for r in range(rounds)]
    gc_ms = [max(records[f"{kind}{r}"].get("step_gc_ms") or [0.0]) for r in range(rounds) for kind in ("steps", "control")]
    return {**figures(runs), "cores_per_rank": float(len(records.get("cores", ()))), "duty": float(duty),
            "freeze_gc": float(freeze_gc), "gc_step_ms_max": float(max(gc_ms))}


class Run:
    """One re-placing run and its control (rank 0's record, ms): step_ms[i] is step i (0: the
    prefill); swaps[i] the layers swapped at the boundary before step i; in_flight[i] whether a
    re-placement was in flight during step i; phases[name][i] whether step i overlapped that
    background phase."""

    def __init__(self, step_ms, swaps, begin_ms, in_flight, num_replacements, control_ms, swap_work_ms=0.0,
                 phases=None, stage_ms=(), cpu_ms=None, control_cpu_ms=None, faults=None):
        n = min(len(step_ms), len(control_ms))
        # the step loop thread's CPU ms in each step (this run's, the control's) and the process's
        # minor page faults in each step; None in records without them
        self.cpu_ms = None if cpu_ms is None else np.asarray(cpu_ms[:n], float)
        self.control_cpu_ms = None if control_cpu_ms is None else np.asarray(control_cpu_ms[:n], float)
        self.faults = None if faults is None else np.asarray(faults[:n], float)
        self.step_ms, self.control_ms = np.asarray(step_ms[:n], float), np.asarray(control_ms[:n], float)
        self.swaps, self.begin_ms = np.asarray(swaps[:n]), np.asarray(begin_ms[:n], float)
        self.in_flight = np.asarray(in_flight[:n], bool)
        self.num_replacements = num_replacements
        self.swap_work_ms = swap_work_ms
        self.phases = {name: np.asarray(mask[:n], bool) for name, mask in (phases or {}).items()}
        self.stage_ms = np.asarray(stage_ms, float)

    @classmethod
    def of(cls, result: dict, control: dict) -> "Run":
        starts = np.asarray(result["step_start_s"], float)
        phases = {name: overlaps(starts, [(a, b) for _, p, _, a, b in result["timeline"] if p == name])
                  for name in PHASES}
        staged: dict[tuple[int, int], float] = {}  # (re-placement, layer) -> seconds staging it
        for i, p, layer, a, b in result["timeline"]:
            if p in ("copy", "send", "pack"):
                staged[i, layer] = staged.get((i, layer), 0.0) + b - a
        ms = lambda xs: np.asarray(xs, float) * 1e3  # noqa: E731
        return cls(ms(np.diff(starts)), result["swaps"], ms(result["begin_s"]), result["step_in_flight"],
                   result["num_replacements"], ms(np.diff(control["step_start_s"])), 1e3 * result["swap_work_s"],
                   phases, ms(list(staged.values())), result.get("step_cpu_ms"), control.get("step_cpu_ms"),
                   result.get("step_process_minflt"))

    def stretches(self) -> list[tuple[int, int]]:
        """[first, end) of each re-placement's stretch: the whole re-placement (from the step it
        started in: the window's snapshot, the plan, the staging, the swaps) with 3 steps before it
        and 1 after its last swap. A re-placement is a run of steps with one in flight; its swaps
        need not be at consecutive boundaries (a layer swaps when every rank has staged it)."""
        n, spans = len(self.step_ms), []
        flight = np.concatenate([[False], self.in_flight, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(flight))
        for first, end in zip(edges[::2], edges[1::2]):
            # the swap that ends a re-placement comes at the boundary of its last step in flight
            swapped = np.flatnonzero(self.swaps[first:min(n, end + 1)]) + first
            if swapped.size:
                spans.append((max(1, int(first) - 3), min(n, int(swapped[-1]) + 2)))
        return spans


def overlaps(starts: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    """[steps] whether step i ([starts[i], starts[i + 1])) overlaps any of ``spans``."""
    mask = np.zeros(max(len(starts) - 1, 0), dtype=bool)
    for a, b in spans:
        mask |= (starts[:-1] < b) & (starts[1:] > a)
    return mask


def figures(runs: list[Run]) -> dict[str, float]:
    near_max, control_max, quiet_max, near_median = [], [], [], []
    in_flight, control_all, swap_steps = [], [], []
    by_phase: dict[str, list[np.ndarray]] = {name: [] for name in PHASES}
    same_steps: dict[str, list[np.ndarray]] = {name: [] for name in PHASES}
    worst_step = (0.0, 0.0, (), None, None)  # (over median, over the control's same step, phases it
    # overlapped, its step-loop CPU over the control's same step's, the process's page faults in it)
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
            i = a + int(np.argmax(run.step_ms[a:b]))
            if run.step_ms[i] / median > worst_step[0]:
                worst_step = (run.step_ms[i] / median, run.step_ms[i] / run.control_ms[i],
                              tuple(name for name, mask in run.phases.items() if mask[i]),
                              None if run.cpu_ms is None else run.cpu_ms[i] / max(run.control_cpu_ms[i], 1e-3),
                              None if run.faults is None else run.faults[i])
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
        for name, mask in run.phases.items():
            by_phase[name].append(run.step_ms[decode & mask])
            same_steps[name].append(run.control_ms[decode & mask])
    control_mean = np.mean(np.concatenate(control_all))
    worst = lambda xs: float(max(xs)) if xs else 0.0  # noqa: E731
    typical = lambda xs: float(np.median(xs)) if len(xs) else 0.0  # noqa: E731
    over_control = lambda xs: float(xs.mean() / control_mean) if xs.size else 0.0  # noqa: E731
    flying, swapped = np.concatenate(in_flight), np.concatenate(swap_steps)
    stage_ms = np.concatenate([r.stage_ms for r in runs])
    result = dict(
        median_step_ms=float(np.median(np.concatenate([r.step_ms[1:] for r in runs]))),
        control_median_step_ms=float(np.median(np.concatenate(control_all))),
        replacement_max_over_median=worst(near_max),
        control_max_over_median=worst(control_max),
        replacement_typical_max_over_median=typical(near_max),
        control_typical_max_over_median=typical(control_max),
        excess_max=worst([a - b for a, b in zip(near_max, control_max)]),
        quiet_max_over_median=typical(quiet_max),
        replacement_median_over_median=typical(near_median),
        replacement_mean_over_control=over_control(flying),
        swap_step_mean_over_control=over_control(swapped),
        swap_loop_ms_max=float(max((r.begin_ms[r.swaps > 0].max() for r in runs if (r.swaps > 0).any()),
                                   default=0.0)),
        swap_work_ms_max=float(max(r.swap_work_ms for r in runs)),
        stage_layer_ms_median=typical(stage_ms),
        replacements=float(sum(len(r.stretches()) for r in runs)),
        swapped_layers=float(sum(r.swaps.sum() for r in runs)),
        rounds=float(len(runs)),
    )
    result["worst_step_over_control_step"] = float(worst_step[1])
    if worst_step[3] is not None:  # did the worst step compute more, or wait (a peer, the GIL, a shared core)?
        result["worst_step_cpu_over_control_cpu"] = float(worst_step[3])
        result["worst_step_page_faults"] = float(worst_step[4])
    for name in PHASES:  # 1: the longest step of any stretch overlapped this background phase
        result[f"worst_step_in_{name}"] = float(name in worst_step[2])
    for name, steps in by_phase.items():
        overlapped = np.concatenate(steps) if steps else np.empty(0)
        if overlapped.size:  # a phase no step overlapped has no figure
            result[f"{name}_step_mean_over_control"] = over_control(overlapped)
            same = np.concatenate(same_steps[name])  # the control's same steps: the workload's own shape out
            result[f"{name}_step_mean_over_control_same_steps"] = float(overlapped.mean() / same.mean())
    return result


def rank_cores(cores: list[int], siblings, world: int, rank: int) -> list[int]:
    """The cores ``rank`` of ``world`` runs on, the step loop's first: the step's own core,
    plus one for the background staging where every rank can have two, and one more for rank 0's
    planner child where every rank can have three.
    Hyperthreads of one physical core share its execution units, so each core comes from a
    physical core of its own while there are enough; ``siblings(c)`` is the set of cores sharing
    ``c``'s physical core (``{c}`` where the machine says nothing)."""
    physical: list[int] = []  # the first core of each physical core, in order
    seen: set[int] = set()
    for c in cores:
        if c not in seen:
            physical.append(c)
            seen |= siblings(c) | {c}
    pool = physical if len(physical) >= world else cores
    per = 3 if len(pool) >= 3 * world else 2 if len(pool) >= 2 * world else 1
    return [pool[(rank * per + k) % len(pool)] for k in range(per)]


def _siblings(core: int) -> set[int]:
    """Cores sharing ``core``'s physical core (Linux sysfs: "0,8" or "0-1"); ``{core}`` elsewhere."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {core}
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out or {core}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank (this file as a script: python replacement_steps.py SPEC.json RANK) --------------------
def _rank_main(spec: dict, rank: int) -> None:
    cores: list[int] = []
    if spec["pin"] and hasattr(os, "sched_setaffinity"):
        cores = rank_cores(sorted(os.sched_getaffinity(0)), _siblings, spec["world"], rank)
        os.sched_setaffinity(0, set(cores))
    import torch

    sys.path.insert(0, str(HARNESS_DIR))
    import ep_harness as harness

    from deepinfer.engine.core.model_runner import ModelRunner
    from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config
    from deepinfer.engine.parallel.expert_parallel import EpSettings, ExpertParallel
    from deepinfer.engine.parallel.group import EpGroup

    torch.set_num_threads(1)
    from deepinfer.engine.core.step_loop import tune_interpreter

    tune_interpreter()  # the engine's GIL switch interval
    gc_ms = [0.0]  # cyclic-GC time since the last step boundary (gc.callbacks)
    gc_started = [0.0]

    def on_gc(phase, _info):
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_started[0]) * 1e3

    gc.callbacks.append(on_gc)
    cfg = dataclasses.replace(tiny_config(LAYERS, NUM_HASH), hidden_size=spec["hidden"],
                              moe_intermediate_size=spec["intermediate"])
    weights = init_weights(cfg, seed=3)
    steps = spec["steps"]
    work = harness.workload(cfg.vocab_size, lengths=[20 + i % 64 for i in range(spec["seqs"])],
                            gens=[steps] * spec["seqs"])  # fmt: skip
    num_owned = len(work.owned(rank, spec["world"]))
    # the step loop's thread keeps the first core, the staging thread, the planner child and the
    # side group's threads the others (EpSettings.background_cpus); the step group's gloo threads
    # keep every core of the rank
    background = tuple(cores[1:])
    world = EpGroup.init(rank, spec["world"], f"tcp://127.0.0.1:{spec['port']}", timeout_s=120,
                         side_cpus=background)
    if background:
        os.sched_setaffinity(0, {cores[0]})
    records: dict = {"cores": cores}
    try:
        for r in range(spec["rounds"]):
            for name, period in ((f"steps{r}", spec["period"]), (f"control{r}", 0)):
                runner = ModelRunner(cfg, weights, num_blocks=num_owned * work.blocks_per_seq,
                                     num_slots=num_owned,
                                     block_size=harness.BLOCK_SIZE)
                settings = EpSettings(redundant_per_rank=2, window=spec["window"], period=period, drift_margin=0.0,
                                      background_duty=spec["duty"], background_cpus=background)
                parallel = ExpertParallel(runner.model, world, settings)
                if spec["freeze_gc"]:  # the model's objects out of the collector (tune_interpreter's option)
                    tune_interpreter(None, freeze_gc=True)
                started = time.perf_counter()
                records[name] = _run(harness, runner, parallel, work, world, gc_ms)
                gc.unfreeze()  # this run's model goes with it
                print(f"rank {rank}: {name} {time.perf_counter() - started:.1f} s", flush=True)
                del runner
    finally:
        world.close()
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(records))


def _run(harness, runner, parallel, work, ep, gc_ms: list[float]) -> dict:
    """One run of the lockstep workload, timed at every step boundary."""
    starts: list[float] = []  # perf_counter at each step boundary, and one at the end
    step_gc: list[float] = []  # ms of cyclic GC inside each step
    swaps: list[int] = []
    begin: list[float] = []  # seconds inside begin_step (agreements and swaps)
    in_flight: list[bool] = []  # a re-placement was in flight during the step (planned, staging, swapping)
    swap_work = [0.0]
    replacements: list = []  # every re-placement started, for its timeline
    # at each boundary: the step loop thread's CPU seconds, its minor page faults and involuntary
    # context switches, and the whole process's minor faults (a slow step that used no more CPU
    # waited: on a peer, the GIL, a core it shared; one with more faults touched new pages)
    usage: list[tuple[float, int, int, int]] = []

    def before_step():
        now = time.perf_counter()
        usage.append(_usage())
        if starts:
            step_gc.append(gc_ms[0])
        gc_ms[0] = 0.0
        starts.append(now)
        replacement = parallel.replacement
        swapped_before = replacement.num_swapped if replacement is not None else 0
        parallel.begin_step()
        begin.append(time.perf_counter() - now)
        in_flight.append(replacement is not None or parallel.replacement is not None)
        swaps.append(replacement.num_swapped - swapped_before if replacement is not None else 0)
        if replacement is not None:
            swap_work[0] = max(swap_work[0], replacement.swap_work_s)
        if parallel.replacement is not None and parallel.replacement is not replacement:
            replacements.append(parallel.replacement)

    harness.run_lockstep(runner, work, work.owned(ep.rank, ep.size), before_step, parallel.idle_step)
    starts.append(time.perf_counter())
    usage.append(_usage())
    step_gc.append(gc_ms[0])
    # a re-placement still in flight finishes untimed (the condition is agreed by the group, so
    # every rank runs the same extra boundaries)
    for _ in range(2000):
        if parallel.replacement is None:
            break
        parallel.begin_step()
        parallel.idle_step()
        time.sleep(0.002)
    if parallel.replacement_error is not None:  # the group served on without it: no figure of a re-placement
        raise RuntimeError(f"EP rank {ep.rank}: {parallel.replacement_error}")
    timeline = [(i, *entry) for i, replacement in enumerate(replacements) for entry in replacement.timeline]
    parallel.close()
    steps_usage = np.diff(np.asarray(usage, dtype=np.float64), axis=0)
    return dict(step_start_s=starts, swaps=swaps, begin_s=begin, step_in_flight=in_flight, timeline=timeline,
                swap_work_s=swap_work[0], num_replacements=parallel.num_replacements, step_gc_ms=step_gc,
                step_cpu_ms=(steps_usage[:, 0] * 1e3).tolist(), step_minflt=steps_usage[:, 1].tolist(),
                step_nivcsw=steps_usage[:, 2].tolist(), step_process_minflt=steps_usage[:, 3].tolist())


def _usage() -> tuple[float, int, int, int]:
    """(this thread's CPU seconds, its minor faults, its involuntary switches, the process's
    minor faults); zeros where the platform has no per-thread usage."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return 0.0, 0, 0, 0
    mine, process = resource.getrusage(who), resource.getrusage(resource.RUSAGE_SELF)
    return time.thread_time(), mine.ru_minflt, mine.ru_nivcsw, process.ru_minflt


if __name__ == "__main__":
    _rank_main(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
