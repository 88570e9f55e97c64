from __future__ import annotations

from deepinfer.cache.store.node_health import NodeHealth
from deepinfer.transport.protocol import DownReason, PeerDown, PeerUp, Role


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_heartbeat_events_mark_storage_nodes_only():
    health = NodeHealth(["s0", "s1", "s2"], suspect_s=2.0)
    health.on_peer_event(PeerDown("s1", Role.STORAGE, 7, DownReason.MISSED_BEATS))
    health.on_peer_event(PeerDown("prefill-0", Role.PREFILL, 8, DownReason.LEFT))
    assert health.down == {"s1"}
    health.on_peer_event(PeerUp("s1", Role.STORAGE, 9))
    assert health.down == set()


def test_suspicion_expires_and_is_cleared_by_an_answer():
    clock = Clock()
    health = NodeHealth(["s0", "s1", "s2"], suspect_s=2.0, clock=clock)
    health.suspect("s0")
    health.suspect("s2")
    assert health.suspects() == {"s0", "s2"}
    health.clear("s2")
    clock.now += 2.5
    assert health.suspects() == set()


def test_writes_avoid_suspects_only_when_enough_nodes_remain():
    health = NodeHealth([f"s{i}" for i in range(5)], suspect_s=2.0, clock=Clock())
    health.mark_down("s0")
    health.suspect("s1")
    assert health.write_skips(3) == {"s0", "s1"}  # 3 left: enough
    assert health.write_skips(4) == {"s0"}  # only 3 would be left: use the suspect


def test_unusable_joins_heartbeats_membership_and_probes():
    unreachable = {}
    health = NodeHealth([f"s{i}" for i in range(5)], suspect_s=2.0, unreachable=unreachable, clock=Clock())
    assert health.unusable() == set()
    health.mark_down("s0")
    health.excluded["s1"] = "draining"
    unreachable["s2"] = "refused the connection"  # the probe's live view, shared
    assert health.unusable() == {"s0", "s1", "s2"}
    assert health.why("s2") == "refused the connection" and health.why("s1") == "marked draining"
    health.suspect("s3")
    assert health.write_skips(1) == {"s0", "s1", "s2", "s3"}
    assert health.write_skips(2) == {"s0", "s1", "s2"}  # a suspect is used before a write fails
