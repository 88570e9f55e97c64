"""The transport benchmark runs end to end at small sizes and reports consistent figures."""

import json

import pytest

from tests.conftest import load_bench_module


@pytest.mark.timeout(180)
def test_bench_transport_small_run_writes_the_named_figures(tmp_path, capsys):
    bench = load_bench_module("transport")
    out = tmp_path / "transport.json"
    assert bench.main(["--sizes", "1MiB", "16MiB", "--repeat", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for size in ("1MiB", "16MiB"):
        memcpy = figures[f"memcpy_{size}_GBps"]
        assert memcpy > 0
        for transport in ("ipc", "tcp", "ipc_frames"):
            gbps = figures[f"{transport}_{size}_GBps"]
            assert 0 < gbps < 1000
            assert figures[f"{transport}_{size}_vs_memcpy"] == pytest.approx(gbps / memcpy, rel=1e-3)
    assert figures["ipc_path"] in ("cma", "frames")
    assert figures["zmq_adopt_ipc_16MiB_GBps"] > 0
    assert figures["loadavg_1m"] >= 0
    table = capsys.readouterr().out
    assert "ipc GB/s" in table and "16MiB" in table


def test_size_parsing_and_labels_round_trip():
    bench = load_bench_module("transport")
    for text in ("1MiB", "16MiB", "256MiB", "64KiB", "1GiB"):
        assert bench.size_label(bench.parse_size(text)) == text
    assert bench.parse_size("1000") == 1000
