"""One rank of the EP tests (a process of its own): ``python ep_rank.py SPEC.json RANK``.

SPEC: {"world": N, "port": P, "out": DIR, "v41_dir": DIR | null, "cases": [case, ...]}; a case
is {"name", "model": "v4" | "v41", "groups": [[world ranks], ...], "settings": {EpSettings
fields}} and optionally "workload": {"lengths", "gens"} (harness.workload), "layers" / "hash"
(the V4's layer kinds and hash layers), "staged_by_step": S (before step S, wait until this
rank has staged a layer of the re-placement in flight, so a swap lands inside the run). For each case the world splits into its groups, each group
runs the whole workload expert-parallel (prompt i on group rank i % size), and each rank writes
``DIR/<name>.g<group>.r<rank>.pt``: its outputs, the placements before and after, re-placement
counts and step times.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ep_harness as harness  # noqa: E402

from deepinfer.engine.parallel.expert_parallel import EpSettings, ExpertParallel  # noqa: E402
from deepinfer.engine.parallel.ep_runner import EpRunner  # noqa: E402
from deepinfer.engine.parallel.group import EpGroup, EpGroupError  # noqa: E402


def run_runner_case(world: EpGroup, spec: dict, case: dict) -> None:
    """Through EpRunner: no manual lockstep; a rank that has finished idles on its poll thread.
    With "die": {"rank": r, "after": k}, rank r exits abruptly after k forwards (writing the time
    first) and the others record the error their next forward raises."""
    ep = EpGroup.split(world, case["groups"])
    group = next(i for i, ranks in enumerate(case["groups"]) if world.rank in ranks)
    runner = harness.v4_runner(num_seqs=8)
    ep_runner = EpRunner(runner, ExpertParallel(runner.model, ep, EpSettings(**case["settings"])), timeout_s=30)
    work = harness.workload(runner.config.vocab_size)
    die = case.get("die")
    out = Path(spec["out"]) / f"{case['name']}.g{group}.r{ep.rank}.pt"
    result = {}
    forwards = [0]

    def count():
        if die and ep.rank == die["rank"] and forwards[0] == die["after"]:
            torch.save({"died_at": time.time()}, out)
            os._exit(17)
        forwards[0] += 1

    try:
        result["outputs"] = harness.run_lockstep(ep_runner, work, work.owned(ep.rank, ep.size), count)
    except EpGroupError as exc:
        result.update(error=str(exc), failed_at=time.time())
    if "error" not in result:
        ep_runner.close()  # returns once every rank has closed: the idle steps are all counted
    result.update(num_steps=ep_runner.num_steps, num_idle_steps=ep_runner.num_idle_steps)
    torch.save(result, out)
    return "error" in result


def run_case(world: EpGroup, spec: dict, case: dict) -> None:
    if case.get("runner") == "ep_runner":
        return run_runner_case(world, spec, case)
    ep = EpGroup.split(world, case["groups"])
    group = next(i for i, ranks in enumerate(case["groups"]) if world.rank in ranks)
    shape = case.get("workload", {})
    lengths, gens = shape.get("lengths", harness.DEFAULT_LENGTHS), shape.get("gens", harness.DEFAULT_GENS)
    num_seqs, blocks = len(lengths), harness.blocks_for(max(lengths), max(gens))
    if case["model"] == "v4":
        runner = harness.v4_runner(num_seqs=num_seqs, layers=case.get("layers", "WCH"), num_hash=case.get("hash", 1),
                                   blocks_per_seq=blocks)
    else:
        runner = harness.v41_runner(spec["v41_dir"], num_seqs=num_seqs, blocks_per_seq=blocks)
    work = harness.workload(runner.config.vocab_size, **shape)
    parallel = ExpertParallel(runner.model, ep, EpSettings(**case["settings"]))
    before = parallel.phy2log
    times: list[float] = []
    swaps: list[int] = []
    begin: list[float] = []  # seconds inside begin_step (agreements and swaps)
    in_flight: list[bool] = []  # a re-placement was in flight during the step (planned, staging, swapping)
    swap_work = [0.0]  # the longest swap work of any re-placement (after the agreement)
    tick = [time.perf_counter()]

    wait_at = case.get("staged_by_step")  # make this step's boundary swap: wait for this rank's staging

    def before_step():
        if wait_at is not None and parallel.num_steps == wait_at and parallel.replacement is not None:
            deadline = time.monotonic() + 60
            while parallel.replacement.num_staged < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        now = time.perf_counter()
        if parallel.num_steps:
            times.append(now - tick[0])
        tick[0] = now
        swapped_before = parallel.replacement.num_swapped if parallel.replacement else 0
        replacement = parallel.replacement
        parallel.begin_step()
        begin.append(time.perf_counter() - now)
        in_flight.append(replacement is not None or parallel.replacement is not None)
        if replacement is not None:
            swap_work[0] = max(swap_work[0], replacement.swap_work_s)
        if replacement is not None:
            swaps.append(replacement.num_swapped - swapped_before)
        else:
            swaps.append(0)

    outputs = harness.run_lockstep(runner, work, work.owned(ep.rank, ep.size), before_step, parallel.idle_step)
    # let a re-placement still in flight finish (between steps, as the loop would); the
    # condition is agreed by the group, so every rank runs the same extra steps
    for _ in range(500):
        if parallel.replacement is None:
            break
        before_step()
        parallel.idle_step()
        time.sleep(0.002)
    result = {
        "outputs": outputs, "before": before, "after": parallel.phy2log, "rules": parallel.state.rules.copy(),
        "num_replacements": parallel.num_replacements, "in_flight": parallel.replacement is not None,
        "step_s": times, "swaps": swaps, "begin_s": begin,
        "step_in_flight": in_flight, "swap_work_s": swap_work[0],
    }
    parallel.close()
    torch.save(result, Path(spec["out"]) / f"{case['name']}.g{group}.r{ep.rank}.pt")


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    print(f"rank {rank}: started in {time.perf_counter() - STARTED:.2f} s", flush=True)
    torch.set_num_threads(1)
    sys.setswitchinterval(0.0005)  # the engine's setting (engine/core/step_loop.tune_interpreter)
    world = EpGroup.init(rank, spec["world"], f"tcp://127.0.0.1:{spec['port']}", timeout_s=60)
    try:
        for case in spec["cases"]:
            start = time.perf_counter()
            broken = run_case(world, spec, case)
            print(f"rank {rank}: {case['name']} {time.perf_counter() - start:.2f} s", flush=True)
            if broken:  # a peer died: leaving the group would wait on it
                sys.stdout.flush()
                os._exit(0)
    finally:
        world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
