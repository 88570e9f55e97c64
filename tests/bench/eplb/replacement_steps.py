"""Step times around expert re-placements in a real EP group (``deepinfer bench eplb --traces steps``).

Two rank processes over gloo (tests/engine/parallel/ep_rank.py) decode the tiny V4 (8 layers
WWCHCHCH, 16 experts top-4, 2 redundant slots per rank) for ``steps`` steps with a re-placement
every ``period`` steps (window ``window``): rank 0 plans in its planner child, every rank stages
the new slots in the background and the layers swap one per step boundary. Figures, from rank 0:

    median_step_ms            all decode steps
    replacement_max_ms        the longest step from 3 steps before a re-placement's first swap to
                              1 after its last, over all re-placements (the target: within 1.2x of
                              the median; ``replacement_max_over_median``)
    quiet_max_over_median     the longest step of a stretch of as many steps away from any
                              re-placement, typical over all such stretches: the noise floor of
                              this machine in the same run (a loaded 2-core machine: 2-3x)
    swap_loop_ms_max          the step loop's own time at a swap (begin_step: the agreement and
                              the pointer swap)
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


def measure(steps: int = 240, window: int = 20, period: int = 40, timeout_s: float = 600) -> dict[str, float]:
    if not RANK_SCRIPT.is_file():
        raise FileNotFoundError(f"the EP rank script {RANK_SCRIPT} is missing (a checkout without tests/engine?)")
    with tempfile.TemporaryDirectory(prefix="eplb-steps-") as out:
        case = dict(name="steps", model="v4", layers="WWCHCHCH", hash=2, groups=[[0, 1]],
                    settings=dict(redundant_per_rank=2, window=window, period=period, drift_margin=0.0),
                    workload=dict(lengths=[20] * 8, gens=[steps] * 8))
        spec = dict(world=2, port=_free_port(), out=out, v41_dir=None, cases=[case])
        spec_file = Path(out) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(spec_file), str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"EP rank {r} exited with {p.returncode}: {logs[r][-2000:]}")
        import torch

        result = torch.load(Path(out) / "steps.g0.r0.pt", weights_only=False)
    return figures(np.array(result["step_s"]) * 1e3, np.array(result["swaps"]), np.array(result["begin_s"]) * 1e3,
                   result["num_replacements"])


def figures(step_ms: np.ndarray, swaps: np.ndarray, begin_ms: np.ndarray, num_replacements: int) -> dict[str, float]:
    """step_ms[i]: step i (0: the prefill); swaps[i]: layers swapped at the boundary before step i."""
    n = step_ms.shape[0]
    swaps, begin_ms = swaps[:n], begin_ms[:n]
    near = np.zeros(n, dtype=bool)
    swap_steps = np.flatnonzero(swaps)
    # one re-placement's swaps are consecutive boundaries; its stretch: 3 steps before to 1 after
    for group in np.split(swap_steps, np.flatnonzero(np.diff(swap_steps) > 1) + 1) if swap_steps.size else []:
        near[max(1, group[0] - 3): group[-1] + 2] = True
    decode = np.arange(n) >= 1
    quiet = decode & ~near
    k = int(near.sum()) // max(1, int(np.sum(np.diff(np.flatnonzero(near)) > 1)) + 1)  # steps per stretch
    # the noise floor: the longest step of a stretch of k quiet steps, typical over all such stretches
    quiet_steps = step_ms[quiet]
    windows = np.lib.stride_tricks.sliding_window_view(quiet_steps, k) if k and quiet_steps.size >= k else None
    return dict(
        median_step_ms=float(np.median(step_ms[decode])),
        replacement_max_ms=float(step_ms[near].max()) if k else 0.0,
        replacement_max_over_median=float(step_ms[near].max() / np.median(step_ms[decode])) if k else 0.0,
        quiet_max_over_median=(float(np.median(windows.max(axis=1)) / np.median(step_ms[decode]))
                               if windows is not None else 0.0),
        replacement_median_over_median=float(np.median(step_ms[near]) / np.median(step_ms[decode])) if k else 0.0,
        swap_loop_ms_max=float(begin_ms[swaps > 0].max()) if swap_steps.size else 0.0,
        replacements=float(num_replacements),
        swapped_layers=float(swaps.sum()),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
