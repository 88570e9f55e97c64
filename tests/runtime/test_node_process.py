"""Real node processes: a peer SIGKILLed mid-request is seen down within the configured silence
(suspicion floor + unanswered probe);
SIGTERM drains gracefully (in-flight work finishes, new work is refused, the process exits 0)."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from deepinfer.runtime.cluster_config import load_cluster_config
from deepinfer.runtime.node import Node, NodeSettings
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import DeadlineExceeded, RemoteError
from deepinfer.transport.ports import free_tcp_port as free_port  # below the ephemeral range
from deepinfer.transport.protocol import DownReason, ErrorCode, Hello, NodeControlReply, PeerDown, PeerUp, Role

INTERVAL = 0.2
MISSED = 3
MIN_SILENCE_S, MAX_SILENCE_S, PROBE_TIMEOUT_S = 0.6, 1.2, 0.3  # quick for the test (defaults 2, 5, 1)

CHILD = textwrap.dedent('''
    import asyncio, sys
    from deepinfer.runtime import loop
    from deepinfer.runtime.cluster_config import load_cluster_config
    from deepinfer.runtime.node import Node, NodeSettings
    from deepinfer.transport.channels import RequestServer
    from deepinfer.transport.protocol import NodeControlRequest, Role, Welcome

    class SlowEchoRole:
        """Answers Hello on the node's data address after instance_id milliseconds."""
        def __init__(self, address):
            self.server = RequestServer(address, NodeControlRequest, self.handle)
        async def start(self, node):
            await self.server.start()
        async def handle(self, incoming):
            await asyncio.sleep(incoming.msg.instance_id / 1000)
            return Welcome(node_name="child", role=Role.DECODE, instance_id=incoming.msg.instance_id)
        async def drain(self, deadline_s):
            await self.server.drain(deadline_s)
        async def stop(self):
            await self.server.close()

    async def main(path):
        config = load_cluster_config(path)
        node = Node(NodeSettings.from_cluster(config, "child"), [SlowEchoRole(config.node("child").data)])
        node.install_signal_handlers()
        await node.start()
        print("READY", flush=True)
        await node.wait_stopped()
        print("STOPPED", flush=True)

    loop.run(main(sys.argv[1]))
''')


@pytest.fixture
def cluster(tmp_path):
    ports = [free_port() for _ in range(5)]
    text = f"""
[cluster]
heartbeat_interval_s = {INTERVAL}
missed_beats = {MISSED}
min_silence_s = {MIN_SILENCE_S}
max_silence_s = {MAX_SILENCE_S}
probe_timeout_s = {PROBE_TIMEOUT_S}
drain_deadline_s = 5

[[nodes]]
name = "observer"
role = "gateway"
control = "tcp://127.0.0.1:{ports[0]}"
events = "tcp://127.0.0.1:{ports[1]}"

[[nodes]]
name = "child"
role = "decode"
control = "tcp://127.0.0.1:{ports[2]}"
events = "tcp://127.0.0.1:{ports[3]}"
data = "tcp://127.0.0.1:{ports[4]}"
"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return path, script


def spawn_child(cluster) -> subprocess.Popen:
    path, script = cluster
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    return proc


def stop_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


async def wait_event(queue, kind, timeout=10.0):
    while True:
        event = await asyncio.wait_for(queue.get(), timeout)
        if isinstance(event, kind):
            return event


def hello(ms: int) -> Hello:
    return Hello(node_name="observer", role=Role.GATEWAY, instance_id=ms)


@pytest.mark.timeout(120)
async def test_peer_killed_mid_request_is_down_within_the_configured_beats(cluster):
    config = load_cluster_config(cluster[0])
    observer = Node(NodeSettings.from_cluster(config, "observer"))
    await observer.start()
    events = observer.heartbeat.subscribe()
    proc = spawn_child(cluster)
    try:
        up = await wait_event(events, PeerUp)
        assert up.node_name == "child"
        async with RequestClient(config.node("child").data, NodeControlReply) as client:
            assert (await client.request(hello(0), timeout_s=5)).node_name == "child"
            in_flight = asyncio.create_task(client.request(hello(30_000), timeout_s=4))
            await asyncio.sleep(0.3)
            loop = asyncio.get_running_loop()
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = loop.time()
            down = await wait_event(events, PeerDown)
            elapsed = loop.time() - killed_at
            assert down == PeerDown("child", Role.DECODE, up.instance_id, DownReason.MISSED_BEATS)
            # silence starts up to one interval before the kill; suspected past the floor, then
            # the probe goes unanswered; the sweep adds at most half an interval
            assert MIN_SILENCE_S - INTERVAL + PROBE_TIMEOUT_S <= elapsed <= MAX_SILENCE_S + PROBE_TIMEOUT_S + 1.0, elapsed
            with pytest.raises(DeadlineExceeded):
                await in_flight  # the stream to the dead peer ends in an explicit error ...
            assert client.num_pending == 0  # ... and leaves nothing behind
        # a restarted child is a new instance: up again, never confused with its previous life
        stop_child(proc)
        proc = spawn_child(cluster)
        again = await wait_event(events, PeerUp)
        assert again.node_name == "child" and again.instance_id != up.instance_id
    finally:
        stop_child(proc)
        await observer.stop()


@pytest.mark.timeout(120)
async def test_sigterm_drains_in_flight_work_refuses_new_and_exits_cleanly(cluster):
    config = load_cluster_config(cluster[0])
    observer = Node(NodeSettings.from_cluster(config, "observer"))
    await observer.start()
    events = observer.heartbeat.subscribe()
    proc = spawn_child(cluster)
    try:
        up = await wait_event(events, PeerUp)
        async with RequestClient(config.node("child").data, NodeControlReply) as client:
            in_flight = asyncio.create_task(client.request(hello(1500), timeout_s=10))
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert observer.heartbeat.table.get("child").is_draining  # peers see it at once
            with pytest.raises(RemoteError) as refused:
                await client.request(hello(0), timeout_s=5)
            assert refused.value.code == ErrorCode.DRAINING
            assert (await in_flight).instance_id == 1500  # finished during the drain
            left = await wait_event(events, PeerDown)
            assert left == PeerDown("child", Role.DECODE, up.instance_id, DownReason.LEFT)
            assert await asyncio.to_thread(proc.wait, 10) == 0
            assert proc.stdout.read().strip() == "STOPPED"
            with pytest.raises(DeadlineExceeded):  # its sockets are closed
                await client.request(hello(0), timeout_s=0.3)
    finally:
        stop_child(proc)
        await observer.stop()


STORAGE_CLUSTER = """
[cluster]
heartbeat_interval_s = 0.2
drain_deadline_s = 5

[storage]
ec_k = 1
ec_m = 0
dir = "{dir}"

[[nodes]]
name = "s0"
role = "storage"
control = "tcp://127.0.0.1:{p0}"
events = "tcp://127.0.0.1:{p1}"
data = "tcp://127.0.0.1:{p2}"
"""


@pytest.mark.timeout(120)
async def test_deepinfer_node_runs_a_built_role_and_drains_on_sigterm(tmp_path):
    from deepinfer.runtime.cluster_config import NodeRole
    from deepinfer.runtime.roles import RoleNotBuilt, role_factory
    from deepinfer.transport.protocol import Welcome

    try:
        role_factory(NodeRole.STORAGE)
    except RoleNotBuilt:
        pytest.skip("the storage role is not built yet")
    ports = [free_port() for _ in range(3)]
    path = tmp_path / "cluster.toml"
    path.write_text(STORAGE_CLUSTER.format(dir=tmp_path / "frags", p0=ports[0], p1=ports[1], p2=ports[2]))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "deepinfer.bin", "node", "--role", "storage",
                                                "--cluster", str(path), stderr=asyncio.subprocess.PIPE)
    try:
        async with RequestClient(f"tcp://127.0.0.1:{ports[0]}", NodeControlReply) as control:
            welcome = await control.request(hello(0), timeout_s=30)  # queued until the node is up
            assert isinstance(welcome, Welcome) and welcome.node_name == "s0" and welcome.role == Role.STORAGE
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
