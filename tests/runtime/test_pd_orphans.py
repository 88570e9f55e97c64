"""``kill -9`` of ``deepinfer serve --disaggregated`` leaves nothing behind: its prefill and decode
processes exit (they used to be re-parented to init, models loaded) and the cluster's socket
directory is removed, within a few seconds."""

from __future__ import annotations

import os
import signal

import pytest

from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.transport.ports import free_tcp_port
from tests.conftest import load_test_helper

served = load_test_helper("runtime/gateway_process")
procs = load_test_helper("runtime/proc_helpers")

ENGINE_FLAGS = ["--dtype", "float32", "--num-blocks", "16", "--max-model-len", "512", "--num-threads", "1"]
GONE_WITHIN_S = 8.0  # stop the node (Leave, close sockets) and exit the interpreter, on a loaded host


@pytest.mark.timeout(180)
def test_sigkill_of_serve_disaggregated_takes_the_engines_and_the_socket_directory_with_it(tmp_path):
    model_dir = tmp_path / "tiny"
    write_tiny_model(model_dir, seed=5, layers="WCHC")
    port = free_tcp_port()
    args = ["--model", str(model_dir), *ENGINE_FLAGS, "--disaggregated", "--prefill", "1", "--decode", "1"]
    engines: list[int] = []
    with served.Served(args, served.serve_env(tmp_path / "cache"), port) as server:
        try:
            engines = procs.children_of(server.proc.pid)
            commands = [procs.cmdline(pid) for pid in engines]
            assert sorted(c[c.index("--role") + 1] for c in commands) == ["decode", "prefill"], commands
            root = os.path.dirname(commands[0][commands[0].index("--cluster") + 1])
            assert os.path.isfile(os.path.join(root, "cluster.toml"))
            assert any(name.endswith(".engine") for name in os.listdir(root))  # the engines' ipc sockets
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            took, alive, present = procs.wait_gone(engines, [root], timeout_s=GONE_WITHIN_S)
            assert not alive, f"engine processes {alive} outlived serve --disaggregated"
            assert not present, f"socket directory {present} left behind"
            print(f"engines gone and {root} removed {took:.2f}s after kill -9 of serve")
        finally:
            for pid in engines:
                if procs.is_running(pid):
                    os.kill(pid, signal.SIGKILL)
