"""Process-table helpers for tests of orphaned children (Linux /proc)."""

from __future__ import annotations

import os
import time


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody reaped yet holds
    no memory and no sockets: it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [part.decode() for part in f.read().split(b"\0") if part]


def wait_gone(pids, paths, timeout_s: float) -> tuple[float, list[int], list[str]]:
    """Poll until every pid has exited and every path is gone: (seconds it took, pids still
    running, paths still there) — the last two empty unless the timeout passed."""
    start = time.monotonic()
    while True:
        alive = [p for p in pids if is_running(p)]
        present = [str(p) for p in paths if os.path.exists(p)]
        elapsed = time.monotonic() - start
        if (not alive and not present) or elapsed > timeout_s:
            return elapsed, alive, present
        time.sleep(0.05)
