"""``deepinfer serve --disaggregated --ep 2`` as a real command: the prefill and the decode engine
are each an EP group of two rank processes (runtime/ep/node_group.py), and greedy completions
equal plain co-located ``deepinfer serve``'s (tiny float32 V4 on CPU). SIGTERM stops every
process: the gateway, both nodes and their rank workers."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from tests.conftest import load_test_helper

pd_serve = load_test_helper("runtime/test_pd_serve")
free_port = pd_serve._free_port

pytestmark = pytest.mark.timeout(300)


def _pids_with(*needles: bytes) -> list[int]:
    """Live processes whose command line holds every needle."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if all(n in cmd for n in needles):
                pids.append(int(entry))
    return pids


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_serve_disaggregated_with_ep2_equals_colocated_serve(tmp_path):
    model_dir = tmp_path / "tiny"
    write_tiny_model(model_dir, seed=5, layers="WCHC")
    bodies = [{"prompt": [(37 * i + 11 * k) % 3900 + 5 for k in range(12 + 9 * i)], "max_tokens": 8,
               "temperature": 0.0} for i in range(3)]
    colocated_port, pd_port = free_port(), free_port()
    colocated = pd_serve._start(model_dir, colocated_port)
    pd = pd_serve._start(model_dir, pd_port, "--disaggregated", "--prefill", "1", "--decode", "1", "--ep", "2",
                         "--ep-redundant-experts", "1")
    try:
        pd_serve._wait_up(colocated, colocated_port)
        pd_serve._wait_up(pd, pd_port)
        nodes = _pids_with(b"node", str(model_dir).encode())
        assert len(nodes) == 2, nodes  # 1 prefill + 1 decode node
        for pid in nodes:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            assert argv[argv.index(b"--ep") + 1] == b"2", argv
        ranks = [pid for pid in _pids_with(b"deepinfer.runtime.ep.rank_worker") if _parent(pid) in nodes]
        assert len(ranks) == 2, ranks  # rank 1 of each node
        model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{pd_port}/v1/models").read())["data"][0]["id"]
        for body in bodies:
            want = pd_serve._complete(colocated_port, model, body)["choices"][0]
            got = pd_serve._complete(pd_port, model, body)["choices"][0]
            assert got["text"], body
            assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), body
    finally:
        assert pd_serve._stop(pd) == 0
        pd_serve._stop(colocated)
    assert not _pids_with(b"node", str(model_dir).encode()), "an engine node outlived serve --disaggregated"
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")], "an EP rank worker outlived it"
