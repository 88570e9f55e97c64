"""The side group's own threads (gloo's workers and socket loop) start on ``side_cpus``, the EP
background CPUs, so re-placement traffic never runs on the step loop's core; the calling thread
keeps its affinity. A real one-rank group in a child process (torch.distributed state is per
process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs Linux affinity and 2 CPUs")]

CHILD = textwrap.dedent("""
    import json, os, socket, sys
    from pathlib import Path
    from deepinfer.engine.parallel.group import EpGroup

    def tasks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
            out[tid] = line.split(":", 1)[1].strip()
        return out

    side = int(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mine = sorted(os.sched_getaffinity(0))
    before = tasks()
    group = EpGroup.init(0, 1, f"tcp://127.0.0.1:{port}", side_cpus=(side,))
    after = tasks()
    print(json.dumps({"new": [after[t] for t in after if t not in before],
                      "mine_after": sorted(os.sched_getaffinity(0)), "mine_before": mine}))
    group.close()
""")


def test_side_group_threads_start_on_the_background_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    side = cpus[-1]
    out = subprocess.run([sys.executable, "-c", CHILD, str(side)], capture_output=True, text=True, timeout=100,
                         check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["mine_after"] == seen["mine_before"]  # the caller is put back
    assert str(side) in seen["new"], seen  # the side group's threads: on the background CPU only
    assert any(a != str(side) for a in seen["new"]), seen  # the step group's: the caller's CPUs
