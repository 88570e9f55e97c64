"""The failure-detection options: ``serve --disaggregated --pd-*`` and ``node`` flags, their one-line
errors, and the path from flags to the cluster config every process of a local cluster reads."""

from __future__ import annotations

import pytest

from deepinfer.bin import cli
from deepinfer.runtime.disagg.cli_args import serve_detector
from deepinfer.runtime.disagg.local_cluster import write_local_cluster
from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.runtime.node import NodeSettings
from tests.conftest import load_test_helper

serve_usage_error = load_test_helper("runtime/gateway_process").serve_usage_error


def test_serve_flags_reach_the_local_cluster_config_and_every_nodes_settings(tmp_path):
    args = cli.build_parser().parse_args(
        ["serve", "--disaggregated", "--pd-heartbeat-interval", "0.1", "--pd-min-silence", "3",
         "--pd-max-silence", "7.5", "--pd-probe-timeout", "0.5", "--pd-suspect-phi", "10"])
    detector = serve_detector(args)
    assert detector == DetectorSettings(interval_s=0.1, suspect_phi=10.0, min_silence_s=3.0, max_silence_s=7.5,
                                        probe_timeout_s=0.5)
    _, config = write_local_cluster(1, 1, transport="tcp", root=tmp_path, detector=detector)
    assert config.cluster.detector == detector  # the gateway's view
    assert NodeSettings.from_cluster(config, "decode-0").detector == detector  # every engine's
    defaults = serve_detector(cli.build_parser().parse_args(["serve", "--disaggregated"]))
    assert defaults == DetectorSettings(interval_s=0.2)
    assert (defaults.min_silence_s, defaults.max_silence_s, defaults.probe_timeout_s) == (2.0, 5.0, 1.0)


@pytest.mark.parametrize("argv, message", [
    (["--pd-min-silence", "6"], "deepinfer serve: peer failure detection: need 0 < min silence <= max silence, "
                                "got 6.0 and 5.0 seconds"),
    (["--pd-probe-timeout", "-1"], "argument --pd-probe-timeout: must be >= 0 and finite, got -1"),
    (["--pd-heartbeat-interval", "0"], "argument --pd-heartbeat-interval: must be > 0 and finite, got 0"),
    (["--pd-suspect-phi", "x"], "argument --pd-suspect-phi: expected a number, got 'x'"),
])
def test_bad_serve_detection_flags_are_one_line_usage_errors(tmp_path, capsys, argv, message):
    code, err = serve_usage_error(tmp_path, capsys, ["--disaggregated", *argv])
    assert code == 2
    assert message in err and len(err.splitlines()) <= 2, err  # argparse prints usage + one line


def test_node_flags_override_the_cluster_config(tmp_path, capsys):
    path, _ = write_local_cluster(1, 1, transport="tcp", root=tmp_path)
    code = cli.main(["node", "--role", "decode", "--cluster", str(path), "--name", "decode-0",
                     "--min-silence", "9", "--max-silence", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "deepinfer node: need 0 < min silence <= max silence, got 9.0 and 4.0 seconds"
