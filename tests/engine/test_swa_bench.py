"""``deepinfer bench swa --quick`` runs end to end and its figures mean what they say."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench_module


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_swa_quick(tmp_path, capsys):
    bench = load_bench_module("swa")
    path = tmp_path / "swa.json"
    assert bench.main(["--quick", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    # the whole-hit replay through the bounded path reproduces the exact state: the quality
    # figures compare against a real reference
    assert data["control_full_replay_top1"] == 1.0 and data["control_full_replay_kl"] < 1e-6
    assert 0.0 <= data["bounded_top1_agreement"] <= 1.0 and data["bounded_mean_kl"] > 0
    # exact replays window * layers = 1024 tokens at a 1K hit, bounded 128: about 8x the FLOPs
    assert 6 < data["exact_vs_bounded_flop_ratio_1k"] < 10
    assert data["exact_vs_bounded_cost_ratio_1k"] > 0
    # the AsyncEngine continuation: a restored slot computes 42 tokens, exact replay 512 + 42
    assert data["continuation_hit_tokens"] == 512
    assert 0 < data["continuation_ttft_ms_restored"] < data["continuation_ttft_ms_exact"]
    table = capsys.readouterr().out
    assert "bounded_tokens" in table and "1024" in table


def test_bench_swa_rejects_bad_hits():
    bench = load_bench_module("swa")
    with pytest.raises(SystemExit):
        bench.main(["--hits", "1000"])
