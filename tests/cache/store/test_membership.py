"""The membership record (file, states, epochs), the read window over states, the token bucket."""

from __future__ import annotations

import os

import pytest

from deepinfer.cache.store.membership import (
    Member,
    Membership,
    MembershipError,
    MembershipFile,
    NodeState,
    load_membership,
    parse_membership,
    save_membership,
)
from deepinfer.cache.store.placement import Placement
from deepinfer.cache.store.rate import TokenBucket
from deepinfer.cache.store.status import ClusterStatus
from deepinfer.transport.protocol import StorageStats


def test_file_round_trip_and_edits(tmp_path):
    path = tmp_path / "members.json"
    record = Membership.of({"a": "tcp://h:1", "b": "tcp://h:2"}, k=1, m=1, epoch=1)
    save_membership(path, record)
    assert load_membership(path) == record
    drained = record.with_state("a", NodeState.DRAINING)
    assert drained.epoch == 2 and drained.names_in(NodeState.DRAINING) == {"a"}
    grown = drained.with_node("c", "tcp://h:3")
    assert grown.epoch == 3 and grown.ranked_names == ["a", "b", "c"]
    removed = grown.with_state("b", NodeState.REMOVED)
    assert removed.ranked_names == ["a", "c"] and "b" not in removed.node2address
    with pytest.raises(MembershipError, match="already a member"):
        grown.with_node("c", "tcp://h:4")
    with pytest.raises(MembershipError, match="no storage node 'zz'"):
        grown.with_state("zz", NodeState.DOWN)


def test_bad_records_say_what_is_wrong():
    with pytest.raises(MembershipError, match="not a membership record"):
        parse_membership("{}")
    with pytest.raises(MembershipError, match=r"nodes\[0\] needs name, address and a state"):
        parse_membership('{"epoch": 1, "ec": "1+1", "nodes": [{"name": "a", "address": "x", "state": "gone"}]}')
    with pytest.raises(MembershipError, match="twice"):
        Membership(1, (Member("a", "x"), Member("a", "y")))


def test_poll_sees_newer_epochs_only(tmp_path):
    path = tmp_path / "members.json"
    first = Membership.of({"a": "tcp://h:1"}, epoch=5)
    save_membership(path, first)
    watcher = MembershipFile(path)
    assert watcher.poll() == first and watcher.poll() is None
    save_membership(path, Membership.of({"a": "tcp://h:1", "b": "tcp://h:2"}, epoch=4))  # a stale copy
    os.utime(path, ns=(1, 1))
    assert watcher.poll() is None and watcher.current == first
    newer = first.with_node("b", "tcp://h:2")
    save_membership(path, newer)
    assert watcher.poll() == newer


def test_read_window_puts_the_group_first_then_draining_nodes():
    nodes = [f"n{i}" for i in range(6)]
    placement = Placement(nodes)
    ranked = list(placement.ranked(b"key"))
    order, skipped = placement.read_window(b"key", 3, 5, unusable={ranked[0]}, draining={ranked[1]})
    assert skipped == [ranked[0]]
    assert order[:3] == ranked[2:5] and order[3] == ranked[1]  # group, then the draining node
    assert placement.read_window(b"key", 3, 4) == (ranked[:4], [])


def test_token_bucket_paces_on_a_fake_clock():
    now = [0.0]
    bucket = TokenBucket(100.0, burst=50.0, clock=lambda: now[0])
    assert bucket.delay_for(50) == 0.0
    bucket.consume(50)
    assert bucket.delay_for(30) == pytest.approx(0.3)
    now[0] += 0.3
    assert bucket.delay_for(30) == 0.0
    bucket.consume(500)  # one large take is allowed; the next ones wait it off
    assert bucket.delay_for(10) == pytest.approx(4.8)  # (10 - (30 - 500)) / 100
    assert TokenBucket(0).delay_for(1e12) == 0.0  # 0: unlimited


def test_status_table_names_states_and_silent_nodes():
    record = Membership.of({"a": "x", "b": "y", "c": "z"}, k=1, m=1, epoch=3).with_state("c", NodeState.DRAINING)

    def stats(name, frags):
        return StorageStats(name, frags, frags * 100, 10_000, 9000, 8000, *[0] * 10, 0.0, 0.0, 1.0,
                            num_repaired=2, membership_epoch=4)  # fmt: skip

    status = ClusterStatus(record, {"a": stats("a", 10), "b": stats("b", 12), "c": None})
    text = status.format()
    assert "draining" in text and "epoch 4" in text
    assert status.num_silent == 1 and status.num_fragments == 22
    assert status.fragment_spread() == pytest.approx(2 / 11)
    line_c = next(line for line in text.splitlines() if line.startswith("c "))
    assert " no " in line_c


def test_an_engine_names_its_cluster_by_the_membership_file(tmp_path):
    from deepinfer.engine.kv.store_cluster import StoreClusterError, build_cluster_store, resolve_store_cluster

    path = tmp_path / "members.json"
    record = Membership.of({"a": "tcp://h:1", "b": "tcp://h:2", "c": "tcp://h:3"}, k=2, m=1, epoch=3)
    save_membership(path, record.with_state("c", NodeState.DRAINING))
    cluster = resolve_store_cluster(str(path))
    assert (cluster.ec_k, cluster.ec_m, cluster.membership_file) == (2, 1, str(path))
    store = build_cluster_store(cluster)
    assert store.membership.epoch == 4 and store.draining == {"c"}  # not started: no sockets yet
    with pytest.raises(StoreClusterError, match="records k and m itself"):
        resolve_store_cluster(str(path), "2+1")
    save_membership(path, record.with_state("c", NodeState.REMOVED))
    with pytest.raises(StoreClusterError, match="lists 2 storage nodes; erasure coding 2\\+1 needs at least 3"):
        resolve_store_cluster(str(path))
