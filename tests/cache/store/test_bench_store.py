from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench_module

KEYS = ["ec_encode_GBps", "pyeclib_encode_GBps", "cluster_get_GBps", "cluster_get_GBps_2_down",
        "hedged_read_p99_ratio_one_slow", "reads_failed_2_down", "healthy_write_GBps", "degraded_write_GBps",
        "degraded_vs_healthy_write", "repair_MBps", "repair_s"]  # fmt: skip


@pytest.mark.timeout(180)
def test_bench_store_small_run_writes_every_figure(tmp_path, capsys):
    bench = load_bench_module("store")
    out = tmp_path / "store.json"
    argv = ["--k", "4", "--m", "2", "--nodes", "6", "--object-size", "65536", "--num-objects", "8",
            "--batch", "4", "--codec-repeat", "2", "--slow-reads", "8", "--slow-delay-ms", "50", "--repair-rounds", "1",
            "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    figures = json.loads(out.read_text())
    for key in KEYS:
        assert key in figures, key
    assert figures["reads_failed_2_down"] == 0
    assert figures["repair_MBps"] > 0 and figures["repaired_fragments"] == 8
    assert figures["cluster_get_GBps"] > 0 and figures["ec_encode_GBps"] > 0
    assert "cluster_get_2_down" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--nodes", "5"])  # cannot hold a 10+2 group
