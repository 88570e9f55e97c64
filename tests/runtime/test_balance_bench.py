"""`deepinfer bench balance` on a reduced trace: the JSON it writes and the ordering it shows."""

import json

import pytest

from tests.conftest import load_bench_module


@pytest.mark.timeout(240)
def test_bench_balance_reduced_trace(tmp_path, capsys):
    bench = load_bench_module("balance")
    out = tmp_path / "balance.json"
    rc = bench.main(["--seed", "0", "--duration", "200", "--warmup", "60", "--prefill", "8", "--decode", "8",
                     "--jobs", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("round-robin", "least-requests", "sglang-cache-aware", "affinity-only", "ours"):
        assert name in printed
    data = json.loads(out.read_text())
    for key in ("decode_balance_efficiency", "ttft_p99_ratio_rr_over_ours", "hit_rate_gap_vs_affinity_points",
                "ours_ttft_p99_s", "round_robin_hit_rate", "sglang_cache_aware_itl_p99_ms"):
        assert key in data, key
    assert 0.0 < data["decode_balance_efficiency"] <= 1.0
    # ours beats round-robin on the tail and on reuse
    assert data["ttft_p99_ratio_rr_over_ours"] > 1.5
    assert data["ours_hit_rate"] > data["round_robin_hit_rate"] + 0.2
    assert data["ours_ttft_p50_s"] < data["round_robin_ttft_p50_s"]


def test_bench_balance_rejects_an_unknown_policy(capsys):
    bench = load_bench_module("balance")
    assert bench.main(["--policies", "ours,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().out
