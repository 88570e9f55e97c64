"""Storage daemons as local child processes on loopback: for tests, benchmarks and laptop clusters.

    with LocalCluster(tmp_dir, num_nodes=12) as cluster:      # node-00 .. node-11, any free ports
        store = ClusterStore(cluster.addresses)
        cluster.kill("node-03")                                 # SIGKILL: a crashed node
        cluster.restart("node-03")                              # same directory, same address

Each node is ``python -m deepinfer.bin storage --dir ROOT/NAME --listen tcp://127.0.0.1:PORT``
(ports chosen up front, below the ephemeral range: transport/ports.py); the cluster waits for its
ready line. With ``membership=True`` the cluster writes ``ROOT/members.json`` (membership.py) and
every node runs with ``--cluster`` on it, so the nodes repair and rebalance; ``add_node`` and
``set_state`` edit that record. Leaving the ``with`` block (or ``stop()``) sends SIGTERM to every
node still running, then SIGKILL to any that has not exited after a grace period.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from deepinfer.cache.store.membership import Membership, NodeState, load_membership, save_membership
from deepinfer.transport.ports import free_tcp_port

_READY = re.compile(r"listening on (\S+)")


class LocalCluster:
    def __init__(
        self,
        root: str | Path,
        num_nodes: int,
        *,
        capacity: str = "1GiB",
        extra_args: Sequence[str] = (),
        node2extra_args: Mapping[str, Sequence[str]] | None = None,
        start_timeout_s: float = 60.0,
        membership: bool = False,
        ec: tuple[int, int] = (10, 2),
    ):
        self.root = Path(root)
        self.names = [f"node-{i:02d}" for i in range(num_nodes)]
        self.membership_path = self.root / "members.json" if membership else None
        self.ec = ec
        self.capacity = capacity
        self.extra_args = list(extra_args)
        self.node2extra_args = dict(node2extra_args or {})
        self.start_timeout_s = start_timeout_s
        self.addresses: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> dict[str, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.addresses = {name: f"tcp://127.0.0.1:{free_tcp_port()}" for name in self.names}
        if self.membership_path is not None:
            save_membership(self.membership_path, Membership.of(self.addresses, k=self.ec[0], m=self.ec[1], epoch=1))
        for name in self.names:  # launch all first: they start up in parallel
            self._spawn(name, self.addresses[name])
        for name in self.names:
            self.addresses[name] = self._wait_ready(name)
        return dict(self.addresses)

    @property
    def membership(self) -> Membership:
        assert self.membership_path is not None, "LocalCluster(membership=True) keeps a membership record"
        return load_membership(self.membership_path)

    def add_node(self, extra_args: Sequence[str] = ()) -> str:
        """Start one more node and make it a member (state up); its name."""
        name = f"node-{len(self.names):02d}"
        self.names.append(name)
        self.node2extra_args[name] = list(extra_args)
        self.addresses[name] = f"tcp://127.0.0.1:{free_tcp_port()}"
        if self.membership_path is not None:
            save_membership(self.membership_path, self.membership.with_node(name, self.addresses[name]))
        self._spawn(name, self.addresses[name])
        self.addresses[name] = self._wait_ready(name)
        return name

    def set_state(self, name: str, state: NodeState) -> Membership:
        record = self.membership.with_state(name, state)
        save_membership(self.membership_path, record)
        return record

    def fragments_on_disk(self, name: str) -> int:
        """Fragment files in the node's directory (counted on disk, whatever the node says)."""
        frags = self.root / name / "frags"
        return sum(1 for sub in frags.iterdir() if sub.is_dir() for _ in sub.iterdir()) if frags.is_dir() else 0

    def _spawn(self, name: str, listen: str) -> None:
        cmd = [
            sys.executable, "-m", "deepinfer.bin", "storage", "--dir", str(self.root / name), "--listen", listen,
            "--capacity", self.capacity, "--name", name, *self.extra_args, *self.node2extra_args.get(name, ()),
        ]  # fmt: skip
        if self.membership_path is not None:
            cmd += ["--cluster", str(self.membership_path)]
        env = {**os.environ, "DEEPINFER_LOG_LEVEL": os.environ.get("DEEPINFER_LOG_LEVEL", "WARNING")}
        self._procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)

    def _wait_ready(self, name: str) -> str:
        proc = self._procs[name]
        deadline = time.monotonic() + self.start_timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"storage node {name} exited with {proc.wait()} before it was ready")
                match = _READY.search(line)
                if match:
                    return match.group(1)
        raise RuntimeError(f"storage node {name} was not ready within {self.start_timeout_s:g}s")

    def is_running(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.poll() is None

    def pid(self, name: str) -> int:
        return self._procs[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL: a crash) and wait for the process to go; its exit code."""
        proc = self._procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        code = proc.wait(timeout=30)
        proc.stdout.close()
        return code

    def restart(self, name: str, extra_args: Sequence[str] | None = None) -> str:
        """Start ``name`` again on its directory and address (after kill/terminate)."""
        if self.is_running(name):
            raise RuntimeError(f"storage node {name} is still running; kill it first")
        if extra_args is not None:
            self.node2extra_args[name] = list(extra_args)
        self._spawn(name, self.addresses[name])
        self.addresses[name] = self._wait_ready(name)
        return self.addresses[name]

    def stop(self, grace_s: float = 10.0) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None and not proc.stdout.closed:
                proc.stdout.close()
