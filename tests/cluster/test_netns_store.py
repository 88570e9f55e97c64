"""The erasure-coded store across hosts: 6 storage hosts (k=4 m=2) in two buildings, each running
``deepinfer node --role storage`` from one cluster file on its own namespace address, and a client
in a 7th host (the gateway's, building A) that writes and reads objects over the bridges.

    building A: gw (client), s0, s1, s2        building B: s3, s4, s5

1. All hosts up: every read hits with identical bytes.
2. The link between the buildings is cut mid-load: the client sees 3 of 6 nodes (< k), so every
   read that starts during the cut fails; each read, there or around it, either hits with
   identical bytes or ends with a typed error (DEADLINE / UNAVAILABLE) within the read deadline
   plus a margin: nothing hangs, nothing returns wrong bytes.
3. The link returns: within 4 s every object written reads back and every node's heartbeat view
   has every other node up again (connections do not wait out TCP's retransmission back-off).
4. Two storage hosts' daemons (one per building) are SIGKILLed mid-load: 0 failed reads.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter

from tests.conftest import load_test_helper

netns = load_test_helper("cluster/netns")
cluster_file = load_test_helper("cluster/cluster_file")
store_client = load_test_helper("cluster/store_client")
store_load = load_test_helper("cluster/store_load")

HOSTS = {"gw": "A", "s0": "A", "s1": "A", "s2": "A", "s3": "B", "s4": "B", "s5": "B"}
STORAGE = [h for h in HOSTS if h.startswith("s")]
READ_BOUND_S = store_load.READ_DEADLINE_S + 1.5  # a read ends by then, hit or typed error
WRITE_BOUND_S = store_load.WRITE_DEADLINE_S + 1.5
# After the link returns every object reads back within RECOVERY_BOUND_S. A 7 s cut is long
# enough that a connection kept through it resumes only at TCP's next retransmission, ~6 s after
# the link returns (request sockets without ZMTP heartbeats did); fresh connections take ~1 s.
RECOVERY_BOUND_S = 4.0
CUT_S = 7.0


def reads(ops, t_from=float("-inf"), t_to=float("inf")):
    """Read ops that started in [t_from, t_to)."""
    return [op for op in ops if op[0] == "read" and t_from <= op[2] < t_to]


def test_store_across_buildings_survives_a_cut_link_and_two_dead_hosts(tmp_path):
    with netns.NetnsCluster(HOSTS, log_dir=tmp_path / "logs") as cluster:
        path = cluster_file.write_cluster_file(
            tmp_path / "cluster.toml", cluster, {h: "storage" for h in STORAGE},
            storage={"ec_k": 4, "ec_m": 2, "dir": str(tmp_path / "fragments"), "capacity_bytes": 256 * 1024**2})
        env = {"DEEPINFER_CACHE_DIR": str(tmp_path / "cache"), "DEEPINFER_LOG_LEVEL": "INFO"}
        daemons = {h: cluster.popen(h, cluster_file.node_command(cluster, path, h, "storage"), env=env) for h in STORAGE}
        for host, proc in daemons.items():  # listening, as seen from the client's host
            cluster.wait_listening("gw", cluster.address(host), cluster_file.DATA_PORT, timeout_s=60, proc=proc)
        client = store_client.StoreLoadClient(cluster, "gw", path, env=env)

        # 1. everyone up
        filled = client.command("fill 24")
        assert filled["failed"] == [] and len(filled["ok"]) == 24
        client.command("load 2")
        time.sleep(1.5)

        # 2. cut the link between the buildings mid-load
        t_cut = time.monotonic()
        cluster.cut_link("A", "B")
        time.sleep(CUT_S)
        t_restore = time.monotonic()
        cluster.restore_link("A", "B")
        time.sleep(1.0)
        ops = client.command("stop")["ops"]
        print_summary("cut", ops, t_cut, t_restore)

        assert all(op[4] in ("HIT", "OK") for op in ops if op[3] < t_cut), "a failure before the cut"
        assert [op for op in ops if op[4] == "WRONG"] == []
        slow = [op for op in reads(ops) if op[3] - op[2] > READ_BOUND_S]
        assert slow == [], f"reads that took more than {READ_BOUND_S} s: {slow[:3]}"
        during = reads(ops, t_cut + 0.2, t_restore)
        assert during, "no read started during the cut"
        assert [op for op in during if op[4] == "HIT"] == [], "a read needing building B hit while it was cut off"
        assert {op[4] for op in during} <= {"DEADLINE", "UNAVAILABLE"}
        far = set(cluster.hosts_in("B"))
        for op in ops:  # an error names the nodes it could not use: building B's, nobody else
            if op[4] == "UNAVAILABLE":
                assert set(re.findall(r"\bs\d\b", op[5])) <= far and op[5], op
        writes = [op for op in ops if op[0] == "write"]
        assert all(op[3] - op[2] <= WRITE_BOUND_S and (op[4] == "OK" or op[5]) for op in writes), writes

        cut_seen_s = min(op[3] for op in during if op[4] == "UNAVAILABLE") - t_cut

        # 3. the link is back: everything written reads back, every node sees every other again
        recovered_after_s = read_everything_back(client, t_restore)
        rejoined_after_s = wait_everyone_sees_everyone(client, t_restore)

        # 4. two storage hosts die mid-load: 0 failed reads
        client.command("load 2")
        time.sleep(1.0)
        t_kill = time.monotonic()
        for host in ("s1", "s4"):
            cluster.kill(daemons[host], signal.SIGKILL)
        time.sleep(2.0)
        ops = client.command("stop")["ops"]
        print_summary("kill", ops, t_kill, t_kill)
        before_kill = [op for op in ops if op[0] == "write" and op[3] < t_kill]
        assert before_kill and all(op[4] == "OK" for op in before_kill), "writes after the link returned failed"
        assert reads(ops, t_kill), "no read started after the kill"
        failed = [op for op in reads(ops) if op[4] != "HIT"]
        assert failed == [], f"{len(failed)} failed reads with 2 of 6 hosts down: {failed[:3]}"
        verify = client.command("verify")["ops"]
        assert [op for op in verify if op[4] != "HIT"] == []
        client.quit()
        print(f"cut seen (first UNAVAILABLE) {cut_seen_s:.2f} s after the cut; after the link returned every "
              f"object read back in {recovered_after_s:.2f} s, every node saw every other in {rejoined_after_s:.2f} s; "
              f"{len(verify)} objects read back after 2 hosts died")


def read_everything_back(client, t_restore: float) -> float:
    """Verify until every written object hits; seconds from the restore until one verify passed."""
    while True:
        verify = client.command("verify")["ops"]
        bad = [op for op in verify if op[4] != "HIT"]
        if not bad:
            return time.monotonic() - t_restore
        assert [op for op in bad if op[4] == "WRONG"] == []
        assert time.monotonic() - t_restore < RECOVERY_BOUND_S, (
            f"{len(bad)} of {len(verify)} objects still unreadable {RECOVERY_BOUND_S} s after the link returned: {bad[:3]}")
        time.sleep(0.2)


def wait_everyone_sees_everyone(client, t_restore: float) -> float:
    """Poll every node's heartbeat view until each sees all others; seconds since the restore."""
    while True:
        node2peers = client.command("peers")["node2peers"]
        missing = {node: sorted(set(STORAGE) - {node} - set(peers or ())) for node, peers in node2peers.items()}
        if not any(missing.values()):
            return time.monotonic() - t_restore
        assert time.monotonic() - t_restore < RECOVERY_BOUND_S, (
            f"{RECOVERY_BOUND_S} s after the link returned, nodes still miss peers: {missing}")
        time.sleep(0.2)


def print_summary(label, ops, t_a, t_b) -> None:
    before = Counter(op[4] for op in ops if op[2] < t_a)
    between = Counter(op[4] for op in ops if t_a <= op[2] < t_b)
    after = Counter(op[4] for op in ops if op[2] >= t_b)
    worst = max((op[3] - op[2] for op in reads(ops)), default=0.0)
    print(f"{label}: before {dict(before)} during {dict(between)} after {dict(after)}; slowest read {worst:.2f} s")
    for status, example in {op[4]: op for op in ops if op[4] not in ("HIT", "OK")}.items():
        print(f"  e.g. {example[0]} {status} after {example[3] - example[2]:.2f} s: {example[5][:120]}")
