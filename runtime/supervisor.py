"""Supervise child processes: start them, restart the ones that die, stop them all cleanly.

    sup = Supervisor([ChildSpec("prefill-0", [sys.executable, "-m", "deepinfer", "node", ...])])
    await sup.start()
    ...
    await sup.stop()          # SIGTERM to all, SIGKILL whoever is left after grace_s

A child that exits while the supervisor runs is restarted after ``restart_delay_s`` (at most
``max_restarts`` times in a row without staying up ``stable_after_s``); its new process is a
new node instance to its peers. ``kill(name)`` / ``restart(name)`` exist for operators and
failure tests: ``kill`` returns once ``on_exit`` has heard of the exit, and a ``restart`` never
races the watcher of the process it replaces (one process per child, whatever the timing).
Children inherit stdout/stderr unless ``log_dir`` is given (then ``<log_dir>/<name>.log``).
``on_exit(name, status)`` hears of every exit while it runs (the launcher tells the gateway's
failure detector: a local death is known, not guessed).

Children never outlive the supervisor: each gets the read end of its lifeline pipe and the
parent's pid (runtime/lifeline.py); a ``deepinfer node`` child stops when the supervising
process dies however it dies (``kill -9`` included) and removes ``cleanup_dir``, the directory
the supervisor's owner made for them (sockets, config).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.runtime.lifeline import Lifeline

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    restart: bool = True


@dataclass(slots=True)
class _Child:
    spec: ChildSpec
    process: asyncio.subprocess.Process | None = None
    num_starts: int = 0
    num_quick_exits: int = 0
    is_held: bool = False  # killed on purpose: do not restart until restart()
    watcher: asyncio.Task | None = None
    exit_heard: asyncio.Event | None = None  # set once the current process's exit went to on_exit


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, log_dir: str | Path | None = None,
                 restart_delay_s: float = 0.5, max_restarts: int = 5, stable_after_s: float = 30.0,
                 grace_s: float = 10.0, cleanup_dir: str | Path | None = None,
                 on_exit: Callable[[str, int], None] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique, got {names}")
        self.children = {s.name: _Child(s) for s in specs}
        self.log_dir = Path(log_dir) if log_dir else None
        self.restart_delay_s = restart_delay_s
        self.max_restarts = max_restarts
        self.stable_after_s = stable_after_s
        self.grace_s = grace_s
        self.cleanup_dir = cleanup_dir
        self._on_exit = on_exit  # (name, status) of a child that exited while we run, before any restart
        self._lifeline: Lifeline | None = None
        self._is_stopping = False

    async def start(self) -> None:
        for child in self.children.values():
            await self._spawn(child)

    def pid(self, name: str) -> int | None:
        process = self.children[name].process
        return process.pid if process is not None and process.returncode is None else None

    def num_starts(self, name: str) -> int:
        return self.children[name].num_starts

    async def kill(self, name: str, sig: int = signal.SIGKILL, *, hold: bool = True) -> None:
        """Send ``sig``; with ``hold`` the child stays down until ``restart(name)``."""
        child = self.children[name]
        child.is_held = hold
        if child.process is not None and child.process.returncode is None:
            child.process.send_signal(sig)
            await child.process.wait()
            await child.exit_heard.wait()  # on_exit heard of it before the caller goes on (restart())

    async def restart(self, name: str) -> None:
        child = self.children[name]
        if child.process is not None and child.process.returncode is not None and child.exit_heard is not None:
            await child.exit_heard.wait()  # still held: the exit is reported, never followed by a respawn
        child.is_held = False
        if child.process is None or child.process.returncode is not None:
            await self._spawn(child)

    async def stop(self) -> None:
        self._is_stopping = True
        running = [c for c in self.children.values() if c.process is not None and c.process.returncode is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        for child in running:
            try:
                await asyncio.wait_for(child.process.wait(), self.grace_s)
            except TimeoutError:
                log.warning("supervisor: %s did not stop within %gs; killing it", child.spec.name, self.grace_s)
                child.process.kill()
                await child.process.wait()
        for child in self.children.values():
            if child.watcher is not None:
                child.watcher.cancel()
        await asyncio.gather(*(c.watcher for c in self.children.values() if c.watcher), return_exceptions=True)
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None

    async def _spawn(self, child: _Child) -> None:
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{child.spec.name}.log", "ab")
        if self._lifeline is None:
            self._lifeline = Lifeline(cleanup_dir=self.cleanup_dir)
        lifeline = self._lifeline
        try:
            # a session of its own: a terminal's Ctrl-C reaches us, and we stop the children
            child.process = await asyncio.create_subprocess_exec(
                *child.spec.argv, env={**os.environ, **child.spec.env, **lifeline.child_env()}, stdout=out,
                stderr=asyncio.subprocess.STDOUT if out else None, start_new_session=True,
                pass_fds=lifeline.pass_fds)
        finally:
            if out is not None:
                out.close()
        child.num_starts += 1
        child.exit_heard = asyncio.Event()
        log.info("supervisor: started %s (pid %d)", child.spec.name, child.process.pid)
        child.watcher = asyncio.create_task(self._watch(child, child.process, child.exit_heard),
                                            name=f"watch-{child.spec.name}")

    async def _watch(self, child: _Child, process: asyncio.subprocess.Process, exit_heard: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            code = await process.wait()
            if self._on_exit is not None and not self._is_stopping:
                try:
                    self._on_exit(child.spec.name, code)
                except Exception:
                    log.exception("supervisor: exit hook failed for %s", child.spec.name)
        finally:
            exit_heard.set()  # cancelled by stop() too: a kill() waiting on it never hangs
        if self._is_stopping or child.is_held or not child.spec.restart or child.process is not process:
            return
        child.num_quick_exits = 0 if loop.time() - started > self.stable_after_s else child.num_quick_exits + 1
        if child.num_quick_exits > self.max_restarts:
            log.error("supervisor: %s exited %d times in a row (last status %d); not restarting it",
                      child.spec.name, child.num_quick_exits, code)
            return
        log.warning("supervisor: %s exited with status %d; restarting in %gs", child.spec.name, code,
                    self.restart_delay_s)
        await asyncio.sleep(self.restart_delay_s)
        if not self._is_stopping and not child.is_held and child.process is process:  # restart() may have run
            await self._spawn(child)
