"""NetnsCluster: many hosts on one Linux machine, each its own network stack (a network namespace),
in buildings joined by a link that can be delayed and cut. Needs root and iproute2 (CI runs as root).

Topology (everything lives in namespaces named ``dinet-<run id>-*``; the machine's own network
namespace gets nothing, and only the namespaces' addresses and their loopbacks are ever used)::

    host ns "gw"          host ns "s0"           host ns "s3"
    lo, eth0 10.91.0.10   lo, eth0 10.91.0.11    lo, eth0 10.91.1.10
         |                     |                      |
    ==== bridge b0 (building A) ====  link  ==== bridge b1 (building B) ====
         fabric ns: the bridges, every host's veth peer, the links between buildings

All hosts share one /16, so any host reaches any other by address; traffic between buildings
crosses the link. The link is a veth pair between the two bridges; with ``link_delay_ms`` it is
delayed by ``tc netem`` where the kernel has it, otherwise by a TAP wire (tap_wire.py: two TAP
devices in the bridges and a relay process between them; ``link_kind`` says which). The delay is
one way: a round trip between buildings costs twice ``link_delay_ms``. ``cut_link`` sets the link's
devices down (``ip link set ... down``): packets are lost silently, as on a cut fibre, no RST;
``restore_link`` sets them up again.

How a test uses it::

    netns = load_test_helper("cluster/netns")

    def test_something(tmp_path):
        with netns.NetnsCluster({"gw": "A", "s0": "A", "s1": "B"}, log_dir=tmp_path) as cluster:
            addr = cluster.address("s0")                     # '10.91.0.11'
            daemon = cluster.popen("s0", cluster.deepinfer("storage", "--dir", str(tmp_path / "s0"),
                                                           "--listen", f"tcp://{addr}:7600"))
            cluster.wait_listening("gw", addr, 7600)          # connect from gw's namespace
            client = cluster.popen("gw", [sys.executable, "client.py", addr], stdout=subprocess.PIPE)
            cluster.cut_link("A", "B")                       # s1 unreachable from gw and s0
            cluster.restore_link("A", "B")
            cluster.kill(daemon)                             # SIGKILL its process group
            text = cluster.output(daemon)                    # its stdout + stderr so far
            result = cluster.call_in("gw", some_function, arg)  # run a function inside gw's namespace

Processes run through ``ip netns exec`` in their own session; their output goes to files under
``log_dir`` (``output(proc)``), or to a pipe when ``stdout=subprocess.PIPE``. Teardown (``close``,
the context manager's exit, and atexit when a test process dies in between) SIGKILLs every process
it started and every process left inside its namespaces, then deletes the namespaces, which deletes
their veths, bridges and TAPs. A run that crashed before its teardown is swept by the next
``NetnsCluster`` to start (netns_runs.py). A machine where namespaces cannot be made raises
NetnsError with the kernel's reason: cluster tests fail, they never skip.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import load_test_helper

_runs = load_test_helper("cluster/netns_runs")
NAME_PREFIX, NetnsError, ip = _runs.NAME_PREFIX, _runs.NetnsError, _runs.ip

TAP_WIRE = Path(__file__).with_name("tap_wire.py")
SUBNET = "10.91"  # every run uses 10.91.0.0/16: runs never share a bridge, so they never collide
CLONE_NEWNET = 0x40000000
WIRE_START_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    building: str
    namespace: str
    address: str  # its one address on eth0, in building's bridge
    fabric_port: str  # its veth peer's name inside the fabric namespace


@dataclass(frozen=True, slots=True)
class BuildingLink:
    buildings: tuple[str, str]
    devices: tuple[str, str]  # in the fabric namespace: the end in each building's bridge


class NetnsCluster:
    def __init__(self, hosts: Mapping[str, str], *, link_delay_ms: float = 0.0, mtu: int = 9000,
                 log_dir: str | Path | None = None):
        """``hosts``: host name -> building name, in the order addresses are given out, e.g.
        ``{"gw": "A", "s0": "A", "s3": "B"}``. ``link_delay_ms``: one-way delay of every link between
        buildings. ``log_dir``: where processes' output files go (default: a fresh temp dir)."""
        if not hosts:
            raise ValueError("a NetnsCluster needs at least one host")
        for name in hosts:
            if not name.replace("-", "").isalnum() or name == "fabric":
                raise ValueError(f"host name {name!r}: use letters, digits and '-' (and not 'fabric')")
        self.run_id = secrets.token_hex(4)
        self.link_delay_ms = float(link_delay_ms)
        self.mtu = mtu
        self.link_kind = "veth"  # "veth", "veth+netem" or "tap-wire", known once built
        self.fabric = f"{NAME_PREFIX}{self.run_id}-fabric"
        self.buildings = list(dict.fromkeys(hosts.values()))
        self.hosts: dict[str, Host] = {}
        per_building = {b: 0 for b in self.buildings}
        for i, (name, building) in enumerate(hosts.items()):
            b = self.buildings.index(building)
            self.hosts[name] = Host(name, building, f"{NAME_PREFIX}{self.run_id}-{name}",
                                    f"{SUBNET}.{b}.{10 + per_building[building]}", f"h{i}")
            per_building[building] += 1
        self.links: dict[frozenset, BuildingLink] = {}
        self._procs: list[subprocess.Popen] = []
        self._proc2log: dict[int, Path] = {}
        self._log_dir = Path(log_dir) if log_dir is not None else Path(f"/tmp/{NAME_PREFIX}{self.run_id}")
        self._is_built = False
        self._is_closed = False

    # ---- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> NetnsCluster:
        _runs.sweep_dead_runs()
        _runs.claim(self.run_id)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._is_built = True
        return self

    def _build(self) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            ip("netns", "add", self.fabric)
        except NetnsError as exc:
            raise NetnsError(f"cannot create a network namespace ({exc}); the cluster tests need root and "
                             "iproute2 with network namespaces (CONFIG_NET_NS)") from None
        ip("-n", self.fabric, "link", "set", "lo", "up")
        for b in range(len(self.buildings)):
            ip("-n", self.fabric, "link", "add", f"b{b}", "mtu", str(self.mtu), "type", "bridge", "stp_state", "0")
            ip("-n", self.fabric, "link", "set", f"b{b}", "up")
        for host in self.hosts.values():
            self._add_host(host)
        for i in range(len(self.buildings)):
            for j in range(i + 1, len(self.buildings)):
                self._add_link(i, j)

    def _add_host(self, host: Host) -> None:
        ns, b = host.namespace, self.buildings.index(host.building)
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.fabric, "link", "add", host.fabric_port, "mtu", str(self.mtu), "type", "veth",
           "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
        ip("-n", self.fabric, "link", "set", host.fabric_port, "master", f"b{b}", "up")
        ip("-n", ns, "addr", "add", f"{host.address}/16", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")

    def _add_link(self, i: int, j: int) -> None:
        a, b = f"l{i}-{j}", f"l{j}-{i}"
        if self.link_delay_ms > 0 and not self._can_netem():
            self.link_kind = "tap-wire"
            a, b = f"w{i}-{j}", f"w{j}-{i}"
            for dev in (a, b):
                ip("-n", self.fabric, "tuntap", "add", "dev", dev, "mode", "tap")
                ip("-n", self.fabric, "link", "set", dev, "mtu", str(self.mtu))
            self._start_wire(a, b)
        else:
            ip("-n", self.fabric, "link", "add", a, "mtu", str(self.mtu), "type", "veth", "peer", "name", b,
               "mtu", str(self.mtu))
            if self.link_delay_ms > 0:
                self.link_kind = "veth+netem"
                for dev in (a, b):
                    _tc(self.fabric, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{self.link_delay_ms}ms")
        ip("-n", self.fabric, "link", "set", a, "master", f"b{i}", "up")
        ip("-n", self.fabric, "link", "set", b, "master", f"b{j}", "up")
        self.links[frozenset((self.buildings[i], self.buildings[j]))] = BuildingLink(
            (self.buildings[i], self.buildings[j]), (a, b))

    def _can_netem(self) -> bool:
        """Whether this kernel has sch_netem (tried on a scratch veth in the fabric namespace)."""
        ip("-n", self.fabric, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        try:
            return _tc(self.fabric, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms", check=False)
        finally:
            ip("-n", self.fabric, "link", "delete", "probe0", check=False)

    def _start_wire(self, a: str, b: str) -> None:
        proc = self._spawn(self.fabric, [sys.executable, str(TAP_WIRE), a, b, str(self.link_delay_ms)],
                           env=None, label=f"wire-{a}", stdout=subprocess.PIPE)
        line = _read_line(proc.stdout, WIRE_START_TIMEOUT_S)
        if line.strip() != "tap wire ready":
            raise NetnsError(f"the TAP wire {a}<->{b} did not start: {line!r} {self._log_text(proc)}")

    def close(self) -> None:
        """Kill every process started here and every process left in the namespaces, delete the
        namespaces (and with them every veth, bridge and TAP). Safe to call more than once."""
        if self._is_closed:
            return
        self._is_closed = True
        atexit.unregister(self.close)
        for proc in self._procs:
            _kill_group(proc, signal.SIGKILL)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdout, proc.stdin):
                if stream is not None:
                    stream.close()
        for namespace in [h.namespace for h in self.hosts.values()] + [self.fabric]:
            _runs.delete_namespace(namespace)
        _runs.release(self.run_id)
        left = [n for n in _runs.list_namespaces() if n.startswith(f"{NAME_PREFIX}{self.run_id}-")]
        if left:
            raise NetnsError(f"teardown left namespaces behind: {', '.join(left)}")

    # ---- addresses and links ----------------------------------------------------------
    def address(self, host: str) -> str:
        return self._host(host).address

    def namespace(self, host: str) -> str:
        return self._host(host).namespace

    def hosts_in(self, building: str) -> list[str]:
        return [h.name for h in self.hosts.values() if h.building == building]

    def cut_link(self, a: str, b: str) -> None:
        """Take the link between buildings ``a`` and ``b`` down: their hosts stop hearing each other."""
        for dev in self._link(a, b).devices:
            ip("-n", self.fabric, "link", "set", dev, "down")

    def restore_link(self, a: str, b: str) -> None:
        for dev in self._link(a, b).devices:
            ip("-n", self.fabric, "link", "set", dev, "up")

    def is_link_up(self, a: str, b: str) -> bool:
        out = [ip("-n", self.fabric, "-o", "link", "show", dev) for dev in self._link(a, b).devices]
        return all(",UP" in line or "<UP" in line for line in out)

    def _link(self, a: str, b: str) -> BuildingLink:
        link = self.links.get(frozenset((a, b)))
        if link is None:
            raise KeyError(f"no link between buildings {a!r} and {b!r}; buildings: {', '.join(self.buildings)}")
        return link

    def _host(self, host: str) -> Host:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r}; hosts: {', '.join(self.hosts)}")
        return self.hosts[host]

    # ---- processes --------------------------------------------------------------------
    @staticmethod
    def deepinfer(*args: str) -> list[str]:
        """argv of the ``deepinfer`` command line of this interpreter's install."""
        return [sys.executable, "-m", "deepinfer.bin", *args]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              label: str = "", stdin=subprocess.DEVNULL, stdout=None) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in a session of its own. ``env`` is added to
        this process's environment. Output goes to a log file (``output``) unless ``stdout`` is
        given (e.g. subprocess.PIPE; stderr still goes to the log file)."""
        if not self._is_built or self._is_closed:
            raise NetnsError("the cluster is not running (use it inside its with block)")
        return self._spawn(self._host(host).namespace, list(argv), env=env,
                           label=label or f"{host}-{Path(argv[0]).name}", stdin=stdin, stdout=stdout)

    def _spawn(self, namespace: str, argv: list[str], *, env, label: str, stdin=subprocess.DEVNULL,
               stdout=None) -> subprocess.Popen:
        log = self._log_dir / f"{label}-{len(self._procs)}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=full_env, stdin=stdin,
                                    stdout=stdout if stdout is not None else log_file, stderr=log_file,
                                    start_new_session=True, text=stdout is not None)
        self._procs.append(proc)
        self._proc2log[proc.pid] = log
        return proc

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``proc``'s whole process group (it and the children it started)."""
        _kill_group(proc, sig)

    def output(self, proc: subprocess.Popen, tail_chars: int = 4000) -> str:
        """The end of what ``proc`` wrote to its log file (stderr, and stdout when not piped)."""
        return self._log_text(proc)[-tail_chars:]

    def _log_text(self, proc: subprocess.Popen) -> str:
        try:
            return self._proc2log[proc.pid].read_text(errors="replace")
        except (KeyError, OSError):
            return ""

    @property
    def processes(self) -> list[subprocess.Popen]:
        return list(self._procs)

    # ---- acting inside a host from this process ---------------------------------------
    def call_in(self, host: str, fn: Callable, *args, timeout_s: float = 60.0):
        """``fn(*args)`` on a thread that lives in ``host``'s network namespace: the sockets it opens
        are that host's. Its result, or its exception re-raised here."""
        result: dict = {}
        path = f"/run/netns/{self._host(host).namespace}"

        def body() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if _libc().setns(fd, CLONE_NEWNET) != 0:
                        raise NetnsError(f"setns into {path}: {os.strerror(ctypes.get_errno())}")
                finally:
                    os.close(fd)
                result["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                result["error"] = exc

        thread = threading.Thread(target=body, name=f"in-{host}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"call_in({host!r}, {getattr(fn, '__name__', fn)}) ran past {timeout_s} s")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def wait_listening(self, from_host: str, address: str, port: int, timeout_s: float = 30.0,
                       proc: subprocess.Popen | None = None) -> float:
        """Wait until ``from_host`` can open a TCP connection to ``address:port``; seconds waited.
        With ``proc``: fail at once, showing its output, when it exits first."""
        start = time.monotonic()

        def probe() -> bool:
            try:
                socket.create_connection((address, port), timeout=1.0).close()
                return True
            except OSError:
                return False

        while not self.call_in(from_host, probe):
            if proc is not None and proc.poll() is not None:
                raise NetnsError(f"process exited with {proc.returncode} before {address}:{port} listened:\n"
                                 f"{self.output(proc)}")
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{address}:{port} not listening (seen from {from_host}) after {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - start


def _tc(namespace: str, *args: str, check: bool = True) -> bool:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)}: {done.stderr.strip()}")
    return done.returncode == 0


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_line(stream, timeout_s: float) -> str:
    """One line from a child's pipe, or '' after ``timeout_s``."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC
