"""``deepinfer serve --disaggregated`` as a real command: the same HTTP completions as plain
co-located ``deepinfer serve`` (greedy and seeded, float32 CPU), and a clean exit on SIGTERM
with every engine process gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.transport.ports import free_tcp_port as _free_port  # below the ephemeral range

ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "128", "--num-blocks", "64", "--max-model-len", "1024",
                "--num-threads", "1", "--no-progress"]


def _start(model_dir, port, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deepinfer.bin", "serve", "--model", str(model_dir),
                             "--port", str(port), *ENGINE_FLAGS, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_up(proc, port, timeout_s=240.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on {port} not healthy within {timeout_s:g}s")


def _complete(port, model, body) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": model, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stop(proc) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(10)
    return proc.returncode


def _engine_pids(model_dir) -> list[int]:
    """Live ``deepinfer node`` processes serving ``model_dir`` (the supervisor's children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"node" in cmd and str(model_dir).encode() in cmd:
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(900)
def test_serve_disaggregated_equals_colocated_serve(tmp_path):
    model_dir = tmp_path / "tiny"
    write_tiny_model(model_dir, seed=5, layers="WCHC")
    bodies = []
    for i in range(8):
        prompt = [(37 * i + 11 * k) % 3900 + 5 for k in range(12 + 9 * i)]
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 40 + i}
        bodies.append({"prompt": prompt, "max_tokens": 10, **sampling})
    colocated_port, pd_port = _free_port(), _free_port()
    colocated = _start(model_dir, colocated_port)
    pd = _start(model_dir, pd_port, "--disaggregated", "--prefill", "1", "--decode", "2")
    try:
        _wait_up(colocated, colocated_port)
        _wait_up(pd, pd_port)
        assert len(_engine_pids(model_dir)) == 3  # 1 prefill + 2 decode processes
        model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{pd_port}/v1/models").read())["data"][0]["id"]
        for body in bodies:
            want = _complete(colocated_port, model, body)["choices"][0]
            got = _complete(pd_port, model, body)["choices"][0]
            assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), body
            assert got["text"], body
    finally:
        assert _stop(pd) == 0
        _stop(colocated)
    assert not _engine_pids(model_dir), "an engine process outlived serve --disaggregated"
