"""Failure detection: the pure peer table with a fake clock, then real nodes on loopback."""

import asyncio

import pytest

from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.runtime.heartbeat import PeerAddress
from deepinfer.runtime.node import Node, NodeSettings
from deepinfer.runtime.peer_table import PeerTable
from deepinfer.transport.channels import EventSubscriber
from deepinfer.transport.ports import free_tcp_port as free_port  # below the ephemeral range
from deepinfer.transport.protocol import (
    TOPIC_PEER,
    DownReason,
    Heartbeat,
    Leave,
    PeerDown,
    PeerEvent,
    PeerUp,
    Role,
)

INTERVAL = 0.1
MISSED = 3
MIN_SILENCE_S, PROBE_TIMEOUT_S = 0.5, 0.3  # quick detection for these tests (defaults: 2 s, 1 s)
# the old fixed rule, for the pure tests: down after 3 s of silence, no probe
FIXED_3S = DetectorSettings(interval_s=1.0, min_silence_s=3.0, max_silence_s=3.0, probe_timeout_s=0.0)


def beat(name="a", instance=1, seq=1, draining=False):
    return Heartbeat(node_name=name, role=Role.DECODE, instance_id=instance, seq=seq, is_draining=draining)


def test_first_beat_is_up_silence_past_threshold_is_down():
    table = PeerTable(FIXED_3S)
    assert table.observe(beat(), now=0.0) == [PeerUp("a", Role.DECODE, 1)]
    assert table.observe(beat(seq=2), now=1.0) == []
    assert table.sweep(now=3.9).events == []  # 2.9 s of silence < 3 beats
    assert table.is_up("a") and table.peers_up() == ["a"]
    assert table.sweep(now=4.1).events == [PeerDown("a", Role.DECODE, 1, DownReason.MISSED_BEATS)]
    assert table.sweep(now=9.0).events == []  # reported once
    assert not table.is_up("a")
    # the same instance coming back (partition healed) is up again
    assert table.observe(beat(seq=9), now=9.5) == [PeerUp("a", Role.DECODE, 1)]


def test_new_instance_is_a_restart_and_old_instance_stays_dead():
    table = PeerTable(FIXED_3S)
    table.observe(beat(instance=1), now=0.0)
    assert table.observe(beat(instance=2), now=0.5) == [
        PeerDown("a", Role.DECODE, 1, DownReason.RESTARTED), PeerUp("a", Role.DECODE, 2)]
    assert table.observe(beat(instance=1, seq=5), now=0.6) == []  # a late beat of the old life
    assert table.get("a").instance_id == 2
    # restart after the old instance was already marked down: only the new one comes up
    table.sweep(now=10.0)
    assert table.observe(beat(instance=3), now=10.1) == [PeerUp("a", Role.DECODE, 3)]


def test_leave_marks_down_at_once_and_only_for_that_instance():
    table = PeerTable(FIXED_3S)
    table.observe(beat(instance=1), now=0.0)
    table.observe(beat(name="b", instance=7, draining=True), now=0.0)
    assert table.get("b").is_draining
    assert table.leave(Leave("a", instance_id=99), now=0.1) == []  # not the live instance
    assert table.leave(Leave("a", instance_id=1), now=0.2) == [PeerDown("a", Role.DECODE, 1, DownReason.LEFT)]
    assert table.observe(beat(instance=1, seq=3), now=0.3) == []  # gone for good
    assert table.peers_up() == ["b"]


def settings(name, port_of, peers=(), **kw):
    return NodeSettings(name=name, role=Role.DECODE, control=f"tcp://127.0.0.1:{port_of[name][0]}",
                        events=f"tcp://127.0.0.1:{port_of[name][1]}",
                        peers=tuple(PeerAddress(p, f"tcp://127.0.0.1:{port_of[p][1]}",
                                                control=f"tcp://127.0.0.1:{port_of[p][0]}") for p in peers),
                        heartbeat_interval_s=INTERVAL, missed_beats=MISSED, min_silence_s=MIN_SILENCE_S,
                        max_silence_s=2 * MIN_SILENCE_S, probe_timeout_s=PROBE_TIMEOUT_S, **kw)


@pytest.fixture
def ports():
    return {name: (free_port(), free_port()) for name in ("a", "b")}


async def next_event(queue, timeout=5.0):
    return await asyncio.wait_for(queue.get(), timeout)


async def test_crash_restart_and_leave_between_real_nodes(ports):
    observer = Node(settings("a", ports, peers=["b"]))
    await observer.start()
    events = observer.heartbeat.subscribe()
    seen_by_listener = []
    observer.add_peer_listener(seen_by_listener.append)
    remote_view = EventSubscriber(PeerEvent, topics=[TOPIC_PEER])
    await remote_view.start()
    remote_view.connect(observer.events.address)
    first = Node(settings("b", ports, peers=["a"]))
    try:
        await first.start()
        up = await next_event(events)
        assert (type(up), up.node_name, up.instance_id) == (PeerUp, "b", first.instance_id)
        # b "crashes" (no Leave) and comes straight back as a new process on the same addresses
        await first.stop(say_goodbye=False)
        second = Node(settings("b", ports, peers=["a"]))
        await second.start()
        down, up = await next_event(events), await next_event(events)
        assert down == PeerDown("b", Role.DECODE, first.instance_id, DownReason.RESTARTED)
        assert up == PeerUp("b", Role.DECODE, second.instance_id)
        assert second.instance_id != first.instance_id
        # a graceful stop says goodbye: down at once, not after missed beats
        loop = asyncio.get_running_loop()
        start = loop.time()
        await second.stop()
        left = await next_event(events)
        assert left == PeerDown("b", Role.DECODE, second.instance_id, DownReason.LEFT)
        assert loop.time() - start < MISSED * INTERVAL
        assert seen_by_listener == [PeerUp("b", Role.DECODE, first.instance_id),
                                    PeerDown("b", Role.DECODE, first.instance_id, DownReason.RESTARTED),
                                    PeerUp("b", Role.DECODE, second.instance_id), left]
        # remote observers got the same events from a's events socket (after the SUB joined)
        remote = []
        while len(remote) < 10:
            try:
                remote.append((await asyncio.wait_for(remote_view.recv(), 0.5))[1])
            except TimeoutError:
                break
        assert remote and remote[-1] == left
    finally:
        await remote_view.close()
        await observer.stop()
        await first.stop()


async def test_silent_peer_that_answers_probes_stays_up_and_one_that_does_not_is_down(ports):
    observer = Node(settings("a", ports, peers=["b"]))
    await observer.start()
    events = observer.heartbeat.subscribe()
    peer = Node(settings("b", ports, peers=["a"]))
    await peer.start()
    try:
        await next_event(events)
        # freeze b's heartbeats only: its control channel still answers, so it is alive
        for task in peer.heartbeat._tasks:
            task.cancel()
        with pytest.raises(TimeoutError):
            await next_event(events, timeout=4 * (MIN_SILENCE_S + PROBE_TIMEOUT_S))
        assert observer.heartbeat.monitor.num_probes_answered >= 2
        assert observer.heartbeat.table.peers_up() == ["b"]
        # now it goes mute on the control channel too (a hung process): probed, unanswered, down
        await peer.control.close()
        loop = asyncio.get_running_loop()
        start = loop.time()
        down = await next_event(events)
        elapsed = loop.time() - start
        assert down.reason == DownReason.MISSED_BEATS and down.node_name == "b"
        assert elapsed <= 2 * MIN_SILENCE_S + PROBE_TIMEOUT_S + 1.0, elapsed
        assert observer.heartbeat.table.peers_up() == []
    finally:
        await peer.stop()
        await observer.stop()
