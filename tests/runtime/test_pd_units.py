"""Pure parts of P/D disaggregation: the lease table, the loopback cluster config, the protocol
round trip with instance ids, the supervisor's restart and hold rules (tiny child processes)."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from deepinfer.runtime.cluster_config import NodeRole
from deepinfer.runtime.disagg.leases import LeaseTable
from deepinfer.runtime.disagg.local_cluster import write_local_cluster
from deepinfer.runtime.supervisor import ChildSpec, Supervisor
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import UnexpectedMessage
from deepinfer.transport.protocol import (
    EngineRef,
    PdDispatch,
    PdEngineRequest,
    PdKvPush,
    PdLeaseRenew,
    PdOutput,
    PdStream,
)


def test_leases_renew_only_for_the_same_decode_instance_and_expire():
    table = LeaseTable(lease_s=2.0)
    table.grant(1, "a", "decode-0", 111, 100, now=0.0)
    table.grant(2, "b", "decode-0", 111, 50, now=0.0)
    table.grant(3, "c", "decode-1", 222, 10, now=0.0)
    assert (table.num_held, table.held_bytes) == (3, 160)
    assert table.renew([1, 3], decode_instance_id=111, now=1.5) == 1  # 3 belongs to another instance
    assert [lease.handoff_id for lease in table.take_expired(2.5)] == [2, 3]
    assert table.num_held == 1 and table.take_expired(3.4) == []
    assert [lease.handoff_id for lease in table.take_expired(3.6)] == [1]


def test_leases_of_a_dead_peer_instance_are_taken_at_once():
    table = LeaseTable(lease_s=30.0)
    table.grant(1, "a", "decode-0", 111, 1, now=0.0)
    table.grant(2, "b", "decode-0", 999, 1, now=0.0)  # the restarted instance's lease survives
    table.grant(3, "c", "decode-1", 222, 1, now=0.0)
    assert [lease.handoff_id for lease in table.take_peer("decode-0", 111)] == [1]
    assert [lease.handoff_id for lease in table.take_request("c")] == [3]
    assert table.release(2).request_id == "b" and table.num_held == 0
    with pytest.raises(ValueError, match="lease_s"):
        LeaseTable(0)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_local_cluster_names_every_engine_address(transport, tmp_path):
    _, config = write_local_cluster(2, 3, transport=transport, root=tmp_path if transport == "tcp" else None)
    assert [n.name for n in config.nodes_with_role(NodeRole.PREFILL)] == ["prefill-0", "prefill-1"]
    decodes = config.nodes_with_role(NodeRole.DECODE)
    assert len(decodes) == 3 and all(d.engine and d.data for d in decodes)
    assert config.node("gateway-0").data and not config.node("gateway-0").engine
    assert all(a.startswith(f"{transport}://") for n in config.nodes for a in (n.control, n.events))
    with pytest.raises(ValueError, match=">= 1 prefill"):
        write_local_cluster(0, 1)


def test_handoff_messages_round_trip_and_stay_on_their_channel():
    ref = EngineRef("decode-1", 42, "ipc:///x.engine", "ipc:///x.data")
    dispatch = PdDispatch("r", 1, [1, 2, 3], b"\x80", 7, 99, ref, "gateway-0", 5, "ipc:///g", resume_token_ids=[4])
    codec = Codec(PdEngineRequest)
    assert codec.decode(codec.encode(dispatch)) == dispatch
    renew = PdLeaseRenew("decode-1", 42, [3, 4], 5.0)
    assert codec.decode(codec.encode(renew)) == renew
    with pytest.raises(UnexpectedMessage):  # a stream message is not an engine request
        codec.decode(codec.encode(PdOutput("r", 1, 42, b"")))
    push = PdKvPush(1, "r", 0, ref, 42, [1], [2], b"", 0, 1, 128, 1, ["b.1.compressed"], "g", 5, "ipc:///g", 5.0,
                    window_start=3, write_from=128)
    assert Codec(PdKvPush).decode(Codec(PdKvPush).encode(push)) == push
    with pytest.raises(UnexpectedMessage):
        Codec(PdStream).decode(codec.encode(dispatch))


async def test_supervisor_restarts_a_killed_child_unless_held():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = Supervisor([ChildSpec("a", sleeper), ChildSpec("b", sleeper, restart=False)], restart_delay_s=0.05)
    await sup.start()
    try:
        pid_a = sup.pid("a")
        await sup.kill("a", signal.SIGKILL, hold=False)
        for _ in range(100):
            if sup.pid("a") not in (None, pid_a):
                break
            await asyncio.sleep(0.05)
        assert sup.pid("a") not in (None, pid_a) and sup.num_starts("a") == 2
        await sup.kill("a")  # held: stays down
        await asyncio.sleep(0.3)
        assert sup.pid("a") is None
        await sup.restart("a")
        assert sup.pid("a") is not None and sup.num_starts("a") == 3
        await sup.kill("b", signal.SIGKILL, hold=False)  # restart=False
        await asyncio.sleep(0.3)
        assert sup.pid("b") is None
    finally:
        await sup.stop()
    assert sup.pid("a") is None
    with pytest.raises(ValueError, match="unique"):
        Supervisor([ChildSpec("x", sleeper), ChildSpec("x", sleeper)])


async def test_supervisor_kill_reports_the_exit_before_returning_and_an_instant_restart_spawns_once():
    """kill() then restart() at once: the exit hook heard of the death first (the gateway marks
    the instance down before the new one exists) and the old process's watcher never spawns a
    second child after restart_delay_s."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    exits = []
    sup = Supervisor([ChildSpec("a", sleeper)], restart_delay_s=0.05,
                     on_exit=lambda name, status: exits.append((name, sup.num_starts(name))))
    await sup.start()
    try:
        await sup.kill("a", hold=False)  # not held: the watcher would restart it after 0.05 s
        assert exits == [("a", 1)]
        await sup.restart("a")
        pid = sup.pid("a")
        await asyncio.sleep(0.4)
        assert sup.num_starts("a") == 2 and sup.pid("a") == pid  # one new process, still the same one
        await sup.kill("a")  # held
        await sup.restart("a")
        assert exits == [("a", 1), ("a", 2)] and sup.num_starts("a") == 3 and sup.pid("a") is not None
    finally:
        await sup.stop()


def test_a_process_exit_seen_locally_is_down_at_once_and_stays_dead():
    from deepinfer.runtime.failure_detector import DetectorSettings
    from deepinfer.runtime.peer_table import PeerTable
    from deepinfer.transport.protocol import DownReason, Heartbeat, PeerDown, PeerUp, Role

    table = PeerTable(DetectorSettings(interval_s=0.2))
    table.observe(Heartbeat(node_name="p", role=Role.PREFILL, instance_id=1, seq=1), 0.0)
    assert table.exited("p") == [PeerDown("p", Role.PREFILL, 1, DownReason.EXITED)]
    assert table.exited("p") == [] and table.exited("nobody") == []
    assert table.observe(Heartbeat(node_name="p", role=Role.PREFILL, instance_id=1, seq=2), 0.1) == []  # late beat
    assert table.observe(Heartbeat(node_name="p", role=Role.PREFILL, instance_id=2, seq=1), 0.2) == \
        [PeerUp("p", Role.PREFILL, 2)]  # the restarted process
