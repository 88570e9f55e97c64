"""`deepinfer serve` (co-located, built-in tiny model) on one host of a NetnsCluster, bound to that
host's namespace address, and clients on two other hosts: one in the same building, one across a
link delayed by 50 ms each way. Both get the same greedy completion over the bridges; the far
client's latency carries the link's round trips (TCP handshake + request/response: at least two)."""

from __future__ import annotations

import http.client
import json
import socket
import time

from tests.conftest import load_test_helper

netns = load_test_helper("cluster/netns")
gateway_harness = load_test_helper("runtime/gateway_harness")

HOSTS = {"srv": "A", "near": "A", "far": "B"}
DELAY_MS = 50.0
RTT_S = 2 * DELAY_MS / 1000
PORT = 8000
BODY = {"model": "deepinfer-tiny", "prompt": "The link between the buildings", "max_tokens": 6, "temperature": 0.0}


def complete(address: str) -> tuple[float, str]:
    """(seconds for one completion on a fresh connection, its text)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(address, PORT, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(BODY), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, payload
    return time.perf_counter() - t0, payload["choices"][0]["text"]


def health(address: str) -> int:
    conn = http.client.HTTPConnection(address, PORT, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def connect_s(address: str) -> float:
    t0 = time.perf_counter()
    socket.create_connection((address, PORT), timeout=10).close()
    return time.perf_counter() - t0


def refused(address: str) -> bool:
    try:
        socket.create_connection((address, PORT), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def test_serve_on_one_host_answers_clients_across_the_bridges(tmp_path):
    gateway_harness.tiny_model_dir()  # the built-in model, written once per machine, before the clock runs
    with netns.NetnsCluster(HOSTS, link_delay_ms=DELAY_MS, log_dir=tmp_path) as cluster:
        srv = cluster.address("srv")
        server = cluster.popen("srv", cluster.deepinfer(
            "serve", "--host", srv, "--port", str(PORT), "--no-progress", "--max-num-seqs", "4", "--num-threads", "1"),
            env={"DEEPINFER_CACHE_DIR": str(gateway_harness.TEST_CACHE_DIR), "DEEPINFER_LOG_LEVEL": "WARNING",
                 "DEEPINFER_BUILTIN_MODEL": "random"})  # the random tiny model the harness wrote
        cluster.wait_listening("near", srv, PORT, timeout_s=120, proc=server)
        assert cluster.call_in("far", health, srv) == 200
        # bound to its namespace address only: its host's loopback does not serve
        assert cluster.call_in("srv", refused, "127.0.0.1")

        cluster.call_in("near", complete, srv)  # warm-up: first-request costs off the measurement
        near, far = [], []
        for _ in range(5):  # interleaved, so load on the machine hits both alike
            near.append(cluster.call_in("near", complete, srv))
            far.append(cluster.call_in("far", complete, srv))
        texts = {text for _, text in near + far}
        assert len(texts) == 1 and texts != {""}, texts  # greedy: the same tokens whoever asks

        handshake_far = min(cluster.call_in("far", connect_s, srv) for _ in range(3))
        near_s, far_s = min(s for s, _ in near), min(s for s, _ in far)
        print(f"handshake far {handshake_far * 1000:.0f} ms; completion near {near_s * 1000:.0f} ms, "
              f"far {far_s * 1000:.0f} ms ({cluster.link_kind}, {DELAY_MS:g} ms each way)")
        assert handshake_far >= 0.95 * RTT_S
        assert far_s >= 0.95 * 2 * RTT_S  # the link's delay is in every far request, whatever the load
        assert far_s - near_s >= 0.5 * 2 * RTT_S, (near, far)  # ... and it is most of the difference between them
