"""The engine's step-by-step traces on 160 seeded random workloads equal the recorded ones.

tests/engine/step_traces.json holds the digests recorded before the engine was reorganised into
subpackages with one step loop: every forward (tables, positions, tokens), every output delta and
the end state must stay bit-for-bit the same. To see what changed for one workload, dump both
traces with step_traces.py and diff them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import load_test_helper

traces = load_test_helper("engine/step_traces")

GOLDEN = Path(__file__).with_name("step_traces.json")


def test_traces_equal_the_recorded_ones():
    golden = json.loads(GOLDEN.read_text())
    assert len(golden) == traces.NUM_WORKLOADS
    changed = [seed for seed, digest in traces.all_digests().items() if golden[seed] != digest]
    assert not changed, f"{len(changed)} of {len(golden)} workloads trace differently, first seeds {changed[:5]}"
