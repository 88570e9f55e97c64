"""The EPLB planner in a child process, so its Python work never holds the step loop's GIL.

A plan for V4-Flash's 43 layers takes seconds of numpy on small arrays; run on a thread of the
engine process it would slow every step it overlaps. ``PlannerProcess`` has ``plan``'s signature;
it starts a child Python on first use (numpy and the planner only: no torch; its priority and
CPUs set before numpy loads, so every thread of the child has them) and talks to it over its
stdin/stdout in frames of an 8-byte length and one .npy array (no pickle):

    request:  header int64 [num_physical, num_gpus, num_nodes, has_history, has_current],
              load, [history], [current]
    reply:    int64 [0] + phy2log, or int64 [1] + the error message as uint8
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import threading

import numpy as np


class PlannerError(RuntimeError):
    """The planner process failed or died; the message says why."""


class PlannerProcess:
    def __init__(self, nice: int = 19, cpus: tuple[int, ...] = ()):
        self.nice = nice  # the child's priority: plans are background work
        self.cpus = tuple(cpus)  # the CPUs the child runs on (empty: the parent's)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def __call__(self, load, num_physical_experts: int, num_gpus: int, num_nodes: int = 1, *, history=None,
                 current=None) -> np.ndarray:
        with self._lock:
            proc = self._start()
            try:
                header = [num_physical_experts, num_gpus, num_nodes, history is not None, current is not None]
                for array in (np.array(header, dtype=np.int64), load, history, current):
                    if array is not None:
                        send(proc.stdin, array)
                proc.stdin.flush()
                status, body = recv(proc.stdout), recv(proc.stdout)
            except (OSError, ValueError, EOFError) as exc:
                self._proc = None
                raise PlannerError(f"the planner process died ({proc.poll()}): {exc}") from exc
        if int(status[0]) != 0:
            raise PlannerError(f"the planner failed: {bytes(body).decode(errors='replace')}")
        return body

    def start(self) -> None:
        """Start the child now (it takes a second or two), not at the first plan."""
        with self._lock:
            self._start()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # one BLAS / OpenMP thread: a plan is small arrays, and a pool of workers (created when
            # numpy loads) would spin on the step loop's cores
            env = dict(os.environ, **{name: "1" for name in _THREAD_VARS})
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(self.nice), ",".join(map(str, self.cpus))],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._proc

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()  # the child's loop ends at end of input
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            self._proc = None


def send(out, array) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    out.write(struct.pack("<Q", buf.tell()) + buf.getvalue())


def recv(inp) -> np.ndarray:
    """The next frame's array; EOFError at a clean end of input."""
    head = inp.read(8)
    if not head:
        raise EOFError("end of input")
    (size,) = struct.unpack("<Q", head)
    body = inp.read(size)
    if len(body) != size:
        raise EOFError(f"a frame of {size} bytes ended after {len(body)}")
    return np.load(io.BytesIO(body), allow_pickle=False)


def serve(inp, out) -> None:
    """The child's loop: one plan per request until end of input."""
    from deepinfer.engine.parallel.eplb.planner import plan

    while True:
        try:
            header = recv(inp)
        except EOFError:
            return
        num_physical, num_gpus, num_nodes, has_history, has_current = header.tolist()
        load = recv(inp)
        history = recv(inp) if has_history else None
        current = recv(inp) if has_current else None
        try:
            result = (np.array([0], dtype=np.int64),
                      plan(load, num_physical, num_gpus, num_nodes, history=history, current=current))
        except Exception as exc:  # reported to the caller, the loop goes on
            result = (np.array([1], dtype=np.int64), np.frombuffer(repr(exc).encode(), dtype=np.uint8))
        for array in result:
            send(out, array)
        out.flush()


_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

# The child's first lines, before numpy (or anything that starts threads) is imported: on Linux
# a thread's priority and CPU set are its own and a new thread copies its creator's, so set on
# the main thread first they hold for every thread the child will have. argv: nice, CPUs.
_BOOT = """
import os, sys
try:
    os.nice(int(sys.argv[1]))  # background work: the step loop comes first
except (OSError, ValueError):
    pass
if sys.argv[2] and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})  # checked by the parent's settings
from deepinfer.engine.parallel.planner_process import serve
serve(sys.stdin.buffer, sys.stdout.buffer)
"""
