"""Node daemon in-process: control channel, role lifecycle, graceful drain, cleanup on failure."""

import asyncio

import pytest
import uvloop

from deepinfer.bin.cli import main as cli_main
from deepinfer.runtime.cluster_config import NodeRole
from deepinfer.runtime.node import Node, NodeSettings, NodeState
from deepinfer.runtime.roles import RoleNotBuilt, role_factory
from deepinfer.transport.channels import Incoming, RequestClient, RequestServer
from deepinfer.transport.errors import DeadlineExceeded, RemoteError
from deepinfer.transport.protocol import (
    Drain,
    DrainAck,
    ErrorCode,
    Hello,
    NodeControlReply,
    NodeControlRequest,
    NodeStatus,
    Role,
    StatusRequest,
    Welcome,
)


class SlowEchoRole:
    """A role serving Hello on its own ROUTER; each reply takes ``instance_id`` milliseconds."""

    def __init__(self, log: list, name: str = "echo", fail_start: bool = False):
        self.server = RequestServer("tcp://127.0.0.1:0", NodeControlRequest, self.handle, name=name)
        self.log, self.name, self.fail_start = log, name, fail_start

    @property
    def num_in_flight(self) -> int:
        return self.server.num_in_flight

    async def start(self, node):
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")
        await self.server.start()
        self.log.append(("start", self.name))

    async def handle(self, incoming: Incoming):
        await asyncio.sleep(incoming.msg.instance_id / 1000)
        return Welcome(node_name=self.name, role=Role.DECODE, instance_id=incoming.msg.instance_id)

    async def drain(self, deadline_s):
        self.log.append(("drain", self.name))
        await self.server.drain(deadline_s)

    async def stop(self):
        self.log.append(("stop", self.name))
        await self.server.close()


def settings(**kw) -> NodeSettings:
    return NodeSettings(name="n0", role=Role.DECODE, control="tcp://127.0.0.1:0", events="tcp://127.0.0.1:0",
                        heartbeat_interval_s=0.1, missed_beats=3, **kw)


def hello(ms: int) -> Hello:
    return Hello(node_name="client", role=Role.GATEWAY, instance_id=ms)


async def test_control_channel_answers_hello_and_status_and_roles_start_in_order():
    log = []
    node = Node(settings(), [SlowEchoRole(log, "first"), SlowEchoRole(log, "second")])
    await node.start()
    try:
        assert node.state is NodeState.RUNNING
        async with RequestClient(node.control.address, NodeControlReply) as client:
            welcome = await client.request(hello(0), timeout_s=5)
            assert welcome == Welcome(node_name="n0", role=Role.DECODE, instance_id=node.instance_id)
            status = await client.request(StatusRequest(), timeout_s=5)
            assert isinstance(status, NodeStatus) and not status.is_draining and status.peers_up == []
            assert status.instance_id == node.instance_id and status.uptime_s >= 0
    finally:
        await node.stop()
    assert log == [("start", "first"), ("start", "second"), ("stop", "second"), ("stop", "first")]
    assert node.state is NodeState.STOPPED
    assert Node(settings()).instance_id != node.instance_id


async def test_drain_finishes_in_flight_refuses_new_aborts_stuck_and_closes_sockets():
    log = []
    role = SlowEchoRole(log)
    node = Node(settings(drain_deadline_s=1.0), [role])
    await node.start()
    async with RequestClient(role.server.address, NodeControlReply) as client, \
            RequestClient(node.control.address, NodeControlReply) as control:
        in_flight = asyncio.create_task(client.request(hello(300), timeout_s=10))
        stuck = asyncio.create_task(client.request(hello(60_000), timeout_s=10))
        while role.num_in_flight < 2:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(node.drain())
        while not node.is_draining:
            await asyncio.sleep(0.01)
        with pytest.raises(RemoteError) as refused:
            await client.request(hello(0), timeout_s=5)
        assert refused.value.code == ErrorCode.DRAINING
        assert (await control.request(StatusRequest(), timeout_s=5)).is_draining  # still answers while draining
        assert (await in_flight).instance_id == 300  # finished, not cut off
        with pytest.raises(RemoteError) as aborted:
            await stuck
        assert aborted.value.code == ErrorCode.CLOSED  # told, at the deadline
        await asyncio.wait_for(drain, 5)
        assert node.state is NodeState.STOPPED
        for channel in (client, control):  # both sockets are gone: nobody answers any more
            with pytest.raises(DeadlineExceeded):
                await channel.request(hello(0), timeout_s=0.3)
    assert log == [("start", "echo"), ("drain", "echo"), ("stop", "echo")]


async def test_drain_message_on_the_control_channel_drains_and_stops():
    node = Node(settings(), [SlowEchoRole([])])
    await node.start()
    async with RequestClient(node.control.address, NodeControlReply) as control:
        ack = await control.request(Drain(deadline_s=2.0), timeout_s=5)
        assert ack == DrainAck(node_name="n0", num_in_flight=0)
        await asyncio.wait_for(node.wait_stopped(), 5)
    assert node.state is NodeState.STOPPED


async def test_a_role_that_fails_to_start_leaves_nothing_running():
    log = []
    node = Node(settings(), [SlowEchoRole(log, "ok"), SlowEchoRole(log, "broken", fail_start=True)])
    before = asyncio.all_tasks()
    with pytest.raises(RuntimeError, match="broken cannot start"):
        await node.start()
    assert log == [("start", "ok"), ("stop", "ok")]
    assert node.state is NodeState.STOPPED
    assert asyncio.all_tasks() - before == set()


def test_node_runs_inside_a_callers_uvloop():
    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        node = Node(settings(), [SlowEchoRole([])])
        await node.start()
        async with RequestClient(node.control.address, NodeControlReply) as control:
            reply = await control.request(hello(0), timeout_s=5)
        await node.drain(deadline_s=1.0)
        return reply.instance_id == node.instance_id, node.state

    assert uvloop.run(main()) == (True, NodeState.STOPPED)


@pytest.mark.parametrize("role", list(NodeRole))
def test_cli_node_for_an_unbuilt_role_exits_2_naming_what_is_missing(role, capsys, tmp_path):
    try:
        role_factory(role)
    except RoleNotBuilt:
        pass
    else:
        pytest.skip(f"the {role.value} role is built")
    assert cli_main(["node", "--role", role.value, "--cluster", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"deepinfer node: not built yet: the {role.value} role") and "\n" not in err


@pytest.fixture
def decode_role_built(monkeypatch):
    """Pretend the decode role exists so the CLI gets past the role check to the config."""
    import deepinfer.runtime.roles as roles

    monkeypatch.setattr(roles, "role_factory", lambda role: lambda **kw: SlowEchoRole([]))


@pytest.mark.parametrize("config, args, message", [
    ("", [], "cluster.toml: cannot read the cluster config"),
    ("[[nodes]]\nname = 'd0'\nrole = 'decod'\ncontrol = 'tcp://127.0.0.1:1'\nevents = 'tcp://127.0.0.1:2'\n", [],
     "nodes[0].role: expected one of gateway, encoder, prefill, decode, storage, got 'decod'"),
    ("[[nodes]]\nname = 'g0'\nrole = 'gateway'\ncontrol = 'tcp://127.0.0.1:1'\nevents = 'tcp://127.0.0.1:2'\n", [],
     "--name is required: the config has 0 decode nodes (none)"),
    ("[[nodes]]\nname = 'g0'\nrole = 'gateway'\ncontrol = 'tcp://127.0.0.1:1'\nevents = 'tcp://127.0.0.1:2'\n",
     ["--name", "g0"], "node 'g0' has role gateway in"),
    ("[[nodes]]\nname = 'g0'\nrole = 'gateway'\ncontrol = 'tcp://127.0.0.1:1'\nevents = 'tcp://127.0.0.1:2'\n",
     ["--name", "zz"], "no node named 'zz'; the config lists g0"),
])
def test_cli_node_config_mistakes_are_one_line_errors(decode_role_built, tmp_path, capsys, config, args, message):
    path = tmp_path / "cluster.toml"
    if config:
        path.write_text(config)
    assert cli_main(["node", "--role", "decode", "--cluster", str(path), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
