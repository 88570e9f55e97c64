"""The engine benchmark runs end to end (tiny settings; its numbers are not asserted here)."""

from __future__ import annotations

import json
import math

from deepinfer.bin.bench import load_bench_module


def test_bench_engine_quick(tmp_path):
    bench = load_bench_module("engine")
    out = tmp_path / "engine.json"
    argv = ["--quick", "--batches", "1,4", "--step-ms", "2", "--default-interpreter", "--json", str(out)]
    assert bench.main(argv) == 0  # --default-interpreter: no process-wide GC/GIL changes in pytest
    data = json.loads(out.read_text())
    for b in (1, 4):
        assert data[f"overhead_ms_b{b}"] > 0
        assert 0.0 <= data[f"overlap_hidden_fraction_b{b}"] <= 1.0
    assert math.isfinite(data["cost_model_median_rel_err"]) and data["cost_model_eval_steps"] > 0
