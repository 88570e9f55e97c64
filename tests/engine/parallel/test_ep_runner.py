"""EpRunner with two real rank processes over gloo: the runner keeps the group in lockstep by
itself (a rank that has finished serves the other's steps from its poll thread) with outputs
equal to one process; a rank that dies mid-run makes the other's next forward fail with
EpGroupError, well within 10 s, instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import load_test_helper

harness = load_test_helper("engine/parallel/ep_harness")
HERE = Path(__file__).resolve().parent
SETTINGS = dict(redundant_per_rank=1, window=4, period=1000, drift_margin=0.0, plan_in_child=False,
                background_nice=0)
CASES = [
    dict(name="lockstep", runner="ep_runner", model="v4", groups=[[0, 1]], settings=SETTINGS),
    dict(name="dies", runner="ep_runner", model="v4", groups=[[0, 1]], settings=SETTINGS,
         die=dict(rank=1, after=5)),
]


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_runner")
    spec = dict(world=2, port=harness.free_port(), out=str(out), v41_dir=None, cases=CASES)
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "ep_rank.py"), str(out / "spec.json"), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out, [p.returncode for p in procs], logs


@pytest.mark.timeout(240)
def test_runner_keeps_lockstep_alone_and_fails_fast_when_a_rank_dies(ranks_out):
    out, codes, logs = ranks_out
    assert codes[1] == 17, f"rank 1 should have died on purpose:\n{logs[1][-2000:]}"
    torch.set_num_threads(1)
    runner = harness.v4_runner(num_seqs=8)
    work = harness.workload(runner.config.vocab_size)
    ref = harness.run_lockstep(runner, work, list(range(8)))

    # lockstep by the runner alone: rank 1 (prompts 1, 3, 5, 7: 9 tokens at most) finishes three
    # steps before rank 0 (12 tokens) and serves those steps from its poll thread
    got = {}
    results = [torch.load(out / f"lockstep.g0.r{r}.pt", weights_only=False) for r in range(2)]
    for res in results:
        got.update(res["outputs"])
    for i, (tokens, rows) in ref.items():
        assert got[i][0] == tokens and torch.equal(got[i][1], rows), f"prompt {i} differs from one process"
    assert results[0]["num_steps"] > results[1]["num_steps"] and results[1]["num_idle_steps"] >= 3

    # rank 1 died after 5 steps: rank 0's next forward failed with the group's error
    died = torch.load(out / "dies.g0.r1.pt", weights_only=False)["died_at"]
    res = torch.load(out / "dies.g0.r0.pt", weights_only=False)
    assert "outputs" not in res, "rank 0 finished its requests without the dead rank's experts"
    assert res["error"].startswith("EP rank 0 of 2 lost the group") and "the group must restart" in res["error"]
    assert res["failed_at"] - died < 10.0, f"the error came {res['failed_at'] - died:.1f} s after the death"
    assert codes[0] == 0, logs[0][-2000:]
