"""Which network namespaces belong to which NetnsCluster run, and removing those of dead runs.

Every run names its namespaces ``dinet-<run id>-<host>`` (8 hex digits of run id) and, before it
creates any, writes ``/run/deepinfer-netns/<run id>.json`` with its pid and that pid's start
time. A later run sweeps namespaces whose run is not alive any more (no record, or the recorded
process gone or replaced by another with the same pid): it kills every process inside them and
deletes them. Deleting a namespace deletes the veths, bridges and TAPs in it, so a crashed run
(SIGKILL, power cut of the test process) leaves nothing behind past the next start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

STATE_DIR = Path("/run/deepinfer-netns")
NAME_PREFIX = "dinet-"
_NAME_RE = re.compile(r"^dinet-([0-9a-f]{8})-")


class NetnsError(RuntimeError):
    """A namespace operation failed; the message names the command and what the kernel said."""


def ip(*args: str, check: bool = True, timeout_s: float = 10.0) -> str:
    """Run ``ip ARGS``; its stdout. A failure raises NetnsError naming the command."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise NetnsError("the 'ip' command (iproute2) is not installed; the netns harness needs it") from None
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def list_namespaces() -> list[str]:
    """Every named network namespace (``ip netns list`` prints 'NAME (id: N)' or 'NAME')."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def run_id_of(namespace: str) -> str | None:
    match = _NAME_RE.match(namespace)
    return match.group(1) if match else None


def claim(run_id: str) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())}
    (STATE_DIR / f"{run_id}.json").write_text(json.dumps(record))


def release(run_id: str) -> None:
    (STATE_DIR / f"{run_id}.json").unlink(missing_ok=True)


def is_run_alive(run_id: str) -> bool:
    try:
        record = json.loads((STATE_DIR / f"{run_id}.json").read_text())
    except (OSError, ValueError):
        return False
    return process_start_ticks(record["pid"]) == record["start_ticks"]


def pids_in(namespace: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", namespace, check=False).split()]


def kill_processes_in(namespace: str, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process in ``namespace`` and wait until they are gone (zombies of ours
    count as gone: the caller reaps them); the pids that were killed."""
    killed = pids_in(namespace)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at and any(_is_running(p) for p in killed):
        time.sleep(0.02)
    return killed


def delete_namespace(namespace: str) -> None:
    kill_processes_in(namespace)
    ip("netns", "delete", namespace, check=False)


def sweep_dead_runs() -> list[str]:
    """Delete the namespaces of runs that are not alive; the names deleted."""
    removed = []
    for namespace in list_namespaces():
        run_id = run_id_of(namespace)
        if run_id is not None and not is_run_alive(run_id):
            delete_namespace(namespace)
            removed.append(namespace)
    live = {run_id_of(n) for n in list_namespaces()}
    if STATE_DIR.is_dir():
        for record in STATE_DIR.glob("*.json"):
            if record.stem not in live and not is_run_alive(record.stem):
                record.unlink(missing_ok=True)
    return removed


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
