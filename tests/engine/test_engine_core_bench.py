"""The engine benchmark runs end to end (tiny settings; timing figures are not asserted, as the
machine is shared, but every figure is present and well-formed)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import load_bench_module


@pytest.mark.timeout(600)
def test_bench_engine_quick(tmp_path):
    bench = load_bench_module("engine")
    out = tmp_path / "engine.json"
    argv = ["--quick", "--batches", "1,4", "--step-ms", "2", "--default-interpreter", "--json", str(out)]
    assert bench.main(argv) == 0  # --default-interpreter: no process-wide GC/GIL changes in pytest
    data = json.loads(out.read_text())
    for b in (1, 4):
        assert data[f"overhead_ms_b{b}"] > 0 and data[f"sync_ms_b{b}"] > data[f"forward_ms_b{b}"]
        assert 0.0 <= data[f"overlap_hidden_fraction_b{b}"] <= 1.0
    assert math.isfinite(data["cost_model_synthetic_median_rel_err"])
    # the real tiny model: cost model judged on held-out steps, engine vs transformers
    assert math.isfinite(data["cost_model_median_rel_err"]) and data["cost_model_eval_steps"] > 0
    for b in (1, 8):
        assert data[f"hf_speedup_b{b}"] > 0 and data[f"tiny_tokens_per_s_b{b}"] > 0
        # greedy on the same weights: our engine reproduces transformers' tokens (a rare
        # near-tie may flip one sequence, as float sums differ in order)
        assert data[f"hf_same_tokens_b{b}"] >= b - 1
    assert data["tiny_tokens_per_s"] == data["tiny_tokens_per_s_b8"]
