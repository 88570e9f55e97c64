"""Children that end with their parent: a supervised process must not outlive its supervisor.

``kill -9`` of ``deepinfer serve --disaggregated`` used to leave its engine processes running
(re-parented to init, holding their models) and their socket directory behind. Two signals tell
a child its parent is gone, and either suffices:

- the *lifeline pipe*: the parent holds the only write end of a pipe (never written, never
  inherited by anyone else); each child gets the read end. When the parent dies, by any means,
  the kernel closes the write end and the read end turns readable (EOF). Works on every POSIX.
- on Linux, ``prctl(PR_SET_PDEATHSIG, SIGHUP)`` also delivers SIGHUP at once, even while the
  child's event loop is not running yet (loading a model).

    # parent (runtime/supervisor.py)
    lifeline = Lifeline(cleanup_dir=root)
    Popen(argv, env={**env, **lifeline.child_env()}, pass_fds=lifeline.pass_fds)
    # child (bin/node.py)
    watch = ParentWatch.from_env()          # None unless a parent asked for it
    watch.arm()                             # early: before the model loads
    watch.watch(loop, on_death=node.stop)   # once the node runs
    ...
    watch.cleanup()                         # the parent died: remove the directory it owned

A SIGHUP while the parent is still there (PDEATHSIG also fires when the parent's *thread* that
forked us exits) is ignored: the parent pid is checked.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deepinfer import envs

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP


class ParentDied(SystemExit):
    """Raised in the child's main thread when its parent died before the node was running."""

    def __init__(self) -> None:
        super().__init__(0)


class Lifeline:
    """The parent's half: one pipe shared by all children, and what to tell them."""

    def __init__(self, *, cleanup_dir: str | Path | None = None):
        self._read_fd, self._write_fd = os.pipe()  # both non-inheritable (PEP 446)
        self.cleanup_dir = Path(cleanup_dir) if cleanup_dir else None

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return () if self._read_fd < 0 else (self._read_fd,)

    def child_env(self) -> dict[str, str]:
        names = envs.names()
        env = {names["parent_pid"]: str(os.getpid()), names["parent_lifeline_fd"]: str(self._read_fd)}
        if self.cleanup_dir is not None:
            env[names["parent_cleanup_dir"]] = str(self.cleanup_dir)
        return env

    def close(self) -> None:
        """After the children are gone: children started later get no lifeline."""
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1


@dataclass(slots=True)
class ParentWatch:
    """The child's half."""

    parent_pid: int
    lifeline_fd: int = -1
    cleanup_dir: str = ""
    has_parent_died: bool = False

    @classmethod
    def from_env(cls, snapshot: envs.Envs | None = None) -> "ParentWatch | None":
        snapshot = snapshot or envs.get()
        if snapshot.parent_pid <= 0:
            return None
        return cls(snapshot.parent_pid, snapshot.parent_lifeline_fd, snapshot.parent_cleanup_dir)

    def is_parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def arm(self, *, use_pdeathsig: bool = True) -> None:
        """Ask the kernel for SIGHUP on the parent's death (Linux) and, until ``watch`` takes
        over, end the process from the main thread when it comes. Raises ``ParentDied`` when
        the parent is already gone. ``use_pdeathsig=False``: the pipe alone (as elsewhere)."""
        signal.signal(PARENT_DEATH_SIGNAL, self._on_signal_early)
        if use_pdeathsig and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
                    log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            except (OSError, AttributeError) as exc:  # no libc prctl: the pipe still works
                log.debug("no prctl: %s", exc)
        if not self.is_parent_alive():  # died before the kernel knew to tell us
            self.has_parent_died = True
            raise ParentDied()

    def watch(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[], None], *,
              hard_exit_after_s: float = 10.0) -> None:
        """From now on the loop handles the parent's death: ``on_death()`` once (e.g. stop the
        node), and a hard exit after ``hard_exit_after_s`` if the process is still there."""

        def died(why: str) -> None:
            if self.has_parent_died:
                return
            if why == "signal" and self.is_parent_alive():
                return  # PDEATHSIG of the forking thread, or a stray SIGHUP: the parent is fine
            self.has_parent_died = True
            log.warning("parent process %d is gone (%s); stopping", self.parent_pid, why)
            if self.lifeline_fd >= 0:
                loop.remove_reader(self.lifeline_fd)
            timer = threading.Timer(hard_exit_after_s, self._hard_exit)
            timer.daemon = True
            timer.start()
            on_death()

        loop.add_signal_handler(PARENT_DEATH_SIGNAL, died, "signal")
        if self.lifeline_fd >= 0:
            try:
                os.set_blocking(self.lifeline_fd, False)
                loop.add_reader(self.lifeline_fd, self._on_readable, died)
            except OSError as exc:  # not our fd after all: rely on the signal
                log.warning("lifeline fd %d unusable: %s", self.lifeline_fd, exc)
                self.lifeline_fd = -1
        if not self.is_parent_alive():
            died("parent pid changed")

    def cleanup(self) -> None:
        """Remove the directory the dead parent owned (its sockets, its config)."""
        if self.cleanup_dir:
            shutil.rmtree(self.cleanup_dir, ignore_errors=True)

    def _on_readable(self, died: Callable[[str], None]) -> None:
        try:
            data = os.read(self.lifeline_fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the last write end closed with the parent
            died("lifeline closed")

    def _on_signal_early(self, signum, frame) -> None:
        if not self.is_parent_alive():
            self.has_parent_died = True
            raise ParentDied()

    def _hard_exit(self) -> None:
        log.error("the node did not stop after its parent died; exiting now")
        self.cleanup()
        os._exit(1)
