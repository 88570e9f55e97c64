"""The netns harness itself: hosts reach each other only over their bridges, the link between
buildings cuts and delays for real, and teardown leaves no namespace, link or process behind,
also after a run that died without its teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.conftest import load_test_helper

netns = load_test_helper("cluster/netns")
runs = load_test_helper("cluster/netns_runs")

ECHO_SERVER = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    def serve(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
    while True:
        threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
""")
PORT = 7000


def root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in runs.ip("-o", "link", "show").splitlines()}


def our_namespaces(cluster) -> list[str]:
    return [n for n in runs.list_namespaces() if n.startswith(f"{runs.NAME_PREFIX}{cluster.run_id}-")]


def start_echo(cluster, host: str, bind: str) -> subprocess.Popen:
    proc = cluster.popen(host, [sys.executable, "-c", ECHO_SERVER, bind, str(PORT)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "listening", cluster.output(proc)
    return proc


def echo(address: str, payload: bytes, timeout_s: float = 2.0) -> bytes:
    with socket.create_connection((address, PORT), timeout=timeout_s) as conn:

        def send() -> None:  # while we read: the echo fills both socket buffers otherwise
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        chunks = []
        while chunk := conn.recv(1 << 16):
            chunks.append(chunk)
        sender.join()
    return b"".join(chunks)


def connect_seconds(address: str) -> float:
    """One TCP handshake's time: a round trip."""
    t0 = time.perf_counter()
    socket.create_connection((address, PORT), timeout=5).close()
    return time.perf_counter() - t0


def can_connect(address: str, timeout_s: float) -> str:
    try:
        socket.create_connection((address, PORT), timeout=timeout_s).close()
        return "connected"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__


def test_hosts_reach_each_other_and_teardown_leaves_nothing(tmp_path):
    links_before = root_links()
    cluster = netns.NetnsCluster({"a1": "A", "a2": "A", "b1": "B"}, log_dir=tmp_path)
    with cluster:
        assert len(our_namespaces(cluster)) == 4  # three hosts + the fabric
        assert cluster.address("a1") != cluster.address("b1")
        assert cluster.hosts_in("A") == ["a1", "a2"]
        server = start_echo(cluster, "b1", cluster.address("b1"))
        loopback_only = start_echo(cluster, "a2", "127.0.0.1")
        payload = os.urandom(3 * 1024 * 1024)
        assert cluster.call_in("a1", echo, cluster.address("b1"), payload) == payload
        # each host has its own loopback: a2's 127.0.0.1 server is not a1's
        assert cluster.call_in("a2", echo, "127.0.0.1", b"ping") == b"ping"
        assert cluster.call_in("a1", can_connect, "127.0.0.1", 1.0) == "ConnectionRefusedError"
        # the machine's own namespace holds none of the cluster's addresses or devices
        assert netns.SUBNET + "." not in runs.ip("-o", "addr", "show")
        assert root_links() == links_before
        pids = [server.pid, loopback_only.pid] + [p.pid for p in cluster.processes]
        inside = {n: runs.pids_in(n) for n in our_namespaces(cluster)}
        assert server.pid in inside[cluster.namespace("b1")]
    assert our_namespaces(cluster) == []
    assert root_links() == links_before
    assert [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) not in ("Z", "X")] == []
    assert all(p.poll() is not None for p in cluster.processes)
    cluster.close()  # twice is fine


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_cut_link_silences_the_other_building_until_restored(tmp_path):
    with netns.NetnsCluster({"a1": "A", "a2": "A", "b1": "B"}, log_dir=tmp_path) as cluster:
        start_echo(cluster, "b1", "0.0.0.0")
        start_echo(cluster, "a2", "0.0.0.0")
        far, near = cluster.address("b1"), cluster.address("a2")
        assert cluster.call_in("a1", can_connect, far, 2.0) == "connected"
        cluster.cut_link("A", "B")
        assert not cluster.is_link_up("A", "B")
        # a cut fibre answers nothing (no refusal): the connect times out; the own building still works
        assert cluster.call_in("a1", can_connect, far, 0.5) == "timeout"
        assert cluster.call_in("b1", can_connect, near, 0.5) == "timeout"
        assert cluster.call_in("a1", can_connect, near, 2.0) == "connected"
        cluster.restore_link("A", "B")
        assert cluster.is_link_up("A", "B")
        assert cluster.call_in("a1", can_connect, far, 2.0) == "connected"
        with pytest.raises(KeyError, match="no link between buildings"):
            cluster.cut_link("A", "C")


def test_link_delay_adds_to_every_round_trip_between_buildings(tmp_path):
    delay_ms = 40.0
    with netns.NetnsCluster({"a1": "A", "a2": "A", "b1": "B"}, link_delay_ms=delay_ms, log_dir=tmp_path) as cluster:
        assert cluster.link_kind in ("veth+netem", "tap-wire")
        start_echo(cluster, "b1", "0.0.0.0")
        start_echo(cluster, "a2", "0.0.0.0")
        far = [cluster.call_in("a1", connect_seconds, cluster.address("b1")) for _ in range(5)]
        near = [cluster.call_in("a1", connect_seconds, cluster.address("a2")) for _ in range(5)]
        # a handshake crosses the link twice; load only adds time, so the fastest one bounds it
        assert min(far) >= 2 * delay_ms / 1000 * 0.95, far
        assert min(near) < delay_ms / 1000, near
        payload = os.urandom(2 * 1024 * 1024)  # big frames through the delayed link arrive intact
        assert cluster.call_in("a1", echo, cluster.address("b1"), payload, 10.0) == payload
        cluster.cut_link("A", "B")
        assert cluster.call_in("a1", can_connect, cluster.address("b1"), 0.5) == "timeout"
        cluster.restore_link("A", "B")
        assert min(cluster.call_in("a1", connect_seconds, cluster.address("b1")) for _ in range(2)) >= 0.076


def test_a_failing_test_still_tears_everything_down(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with netns.NetnsCluster({"h1": "A", "h2": "B"}, log_dir=tmp_path) as cluster:
            sleeper = cluster.popen("h1", ["sleep", "300"])
            raise RuntimeError("the test failed")
    assert our_namespaces(cluster) == [] and sleeper.poll() is not None


EXITING_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from tests.conftest import load_test_helper
    netns = load_test_helper("cluster/netns")
    cluster = netns.NetnsCluster({"x1": "A", "y1": "B"}, link_delay_ms=5, log_dir=sys.argv[2]).start()
    print(cluster.run_id, cluster.popen("x1", ["sleep", "300"]).pid, flush=True)
    sys.exit(3)  # leaves without close(): atexit tears down
""")


def test_a_process_that_exits_without_close_tears_down_at_exit(tmp_path):
    repo = netns.__file__.rsplit("/tests/", 1)[0]
    done = subprocess.run([sys.executable, "-c", EXITING_RUN, repo, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    run_id, sleeper = done.stdout.split()
    assert [n for n in runs.list_namespaces() if runs.run_id_of(n) == run_id] == []
    assert _state(int(sleeper)) in ("Z", "X")


CRASHING_RUN = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.conftest import load_test_helper
    netns = load_test_helper("cluster/netns")
    cluster = netns.NetnsCluster({"x1": "A", "y1": "B"}, link_delay_ms=5, log_dir=sys.argv[2]).start()
    sleeper = cluster.popen("x1", ["sleep", "300"])
    print(cluster.run_id, sleeper.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies without its teardown (atexit does not run)
""")


def test_a_crashed_run_is_swept_by_the_next_start(tmp_path):
    repo = netns.__file__.rsplit("/tests/", 1)[0]
    done = subprocess.run([sys.executable, "-c", CRASHING_RUN, repo, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    run_id, sleeper = done.stdout.split()
    leftovers = [n for n in runs.list_namespaces() if runs.run_id_of(n) == run_id]
    assert len(leftovers) == 3 and _state(int(sleeper)) not in ("Z", "X")  # the crash left them
    with netns.NetnsCluster({"z1": "A"}, log_dir=tmp_path / "next") as cluster:
        assert [n for n in runs.list_namespaces() if runs.run_id_of(n) == run_id] == []
        assert _state(int(sleeper)) in ("Z", "X")
        assert our_namespaces(cluster)  # the sweep spared the live run


def test_a_machine_without_namespaces_fails_with_the_reason(tmp_path):
    """Without CAP_SYS_ADMIN `ip netns add` cannot work: the harness says so (tests fail, never skip)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.conftest import load_test_helper; "
            "netns = load_test_helper('cluster/netns'); netns.NetnsCluster({'h': 'A'}, log_dir=sys.argv[2]).start()")
    repo = netns.__file__.rsplit("/tests/", 1)[0]
    done = subprocess.run(["capsh", "--drop=cap_sys_admin", "--", "-c",
                           f"exec {sys.executable} -c \"{code}\" {repo} {tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("netns_runs.NetnsError: cannot create a network namespace"), done.stderr
    assert "Operation not permitted" in last and "need root" in last
