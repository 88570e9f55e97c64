"""An expert-parallel group behind a P/D engine node: ``deepinfer node --role prefill|decode --ep N``.

    node process:   the P/D service (engine RPC, KV handoff) over rank 0's engine core
                    (EngineOptions.expert_parallel = rank 0 of N; its runner is an EpRunner)
    N - 1 children: ranks 1 .. N-1 (runtime/ep/rank_worker.py), each an engine over an EpRunner
                    that takes no requests: its poll thread serves its experts to rank 0's steps

The node's requests run on rank 0 (the P/D handoff reads and writes that engine's KV cache);
every MoE layer of its steps is expert-parallel over the group, as ``serve --ep N`` is.

A rank that dies breaks the group: rank 0's next step fails (its collective sees the closed
connection) and the engine loop fails that step's requests with the group's reason (``EP rank 0
of N lost the group ...``). ``EpNodeRole`` then drains what is left within a short grace and
ends the node process with ``EXIT_GROUP_BROKEN``: its supervisor (``serve --disaggregated``'s,
or the operator's) starts a new node, a new instance to its peers, which forms a new group. A
group cannot be re-formed inside a process that lost one (torch.distributed's threads may still
wait on the dead peer), so the restart is the process's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

from deepinfer.engine.parallel.settings import EpSettings, EpSettingsError, ExpertParallelSpec

log = logging.getLogger(__name__)

EXIT_GROUP_BROKEN = 3  # the node's exit status after its EP group broke (as a rank worker's)
WATCH_S = 0.05  # how often the role looks at its ranks
FAIL_GRACE_S = 2.0  # after a break: time for the failed requests' replies to leave
# EngineOptions the helper ranks share with rank 0 (the model's shape and numerics); store, SWA
# and scheduling knobs stay rank 0's: the helpers hold no requests
SHARED_OPTIONS = ("dtype", "max_model_len", "block_size", "num_threads", "batch_invariant", "device")


class EpNodeGroup:
    """Ranks 1 .. N-1 of the group whose rank 0 is this process's engine."""

    def __init__(self, model_dir: str, size: int, options: dict, settings: EpSettings, *, timeout_s: float = 30.0):
        if not isinstance(size, int) or size < 2:
            raise EpSettingsError(f"an EP group behind a node needs --ep >= 2, got {size!r}")
        self.model_dir, self.size, self.settings, self.timeout_s = str(model_dir), size, settings, timeout_s
        self.options = {k: v for k, v in options.items() if k in SHARED_OPTIONS and v is not None}
        self.options.update(max_num_seqs=1, skip_tokenizer_init=True)
        self.procs: list[subprocess.Popen] = []
        self.init_method = ""

    def start(self) -> ExpertParallelSpec:
        """Start ranks 1 .. N-1; rank 0's spec (building its engine joins the group and waits for them)."""
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(1, self.size):
            config = dict(model=self.model_dir, options=self.options, rank=rank, size=self.size,
                          init_method=self.init_method, settings=asdict(self.settings), timeout_s=self.timeout_s)
            # stdin is the rank's lifeline (it exits at end of input); its replies are not read
            self.procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer.runtime.ep.rank_worker",
                                                json.dumps(config)], stdin=subprocess.PIPE,
                                               stdout=subprocess.DEVNULL))
        return ExpertParallelSpec(rank=0, size=self.size, init_method=self.init_method, settings=self.settings,
                                  timeout_s=self.timeout_s)

    def lost(self) -> str | None:
        """Which helper rank has exited, and how; None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"EP rank {rank} of {self.size} (pid {proc.pid}) exited with status {proc.returncode}"
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        """End the helper ranks: end of input (a clean close when rank 0 closes too), then kill."""
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


class EpNodeRole:
    """A node role (``runtime.node.Role``) around a P/D service whose engine is rank 0 of ``group``;
    ends the node process when the group breaks (module docstring)."""

    def __init__(self, service, group: EpNodeGroup, *, exit_fn=os._exit):
        self.service, self.group = service, group
        self._exit = exit_fn  # os._exit: gloo's threads may wait on the dead peer forever
        self._watch: asyncio.Task | None = None
        self.broken: str | None = None

    def __getattr__(self, name):  # the service's own surface (status, metrics, tests)
        return getattr(self.service, name)

    async def start(self, node) -> None:
        self._node = node
        await self.service.start(node)
        self._watch = asyncio.get_running_loop().create_task(self._watch_group(), name="ep-node-group")

    async def drain(self, deadline_s: float) -> None:
        await self.service.drain(deadline_s)

    async def stop(self) -> None:
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        await self.service.stop()
        runner = self.service.core.runner
        if self.broken is None and not getattr(runner, "is_broken", False):
            # the group's last round: rank 0 and the helpers (end of input) close together
            closing = asyncio.get_running_loop().run_in_executor(None, runner.close)
            await asyncio.get_running_loop().run_in_executor(None, self.group.stop)
            await closing
        else:
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.group.stop(grace_s=1.0))

    async def _watch_group(self) -> None:
        runner = self.service.core.runner
        while True:
            await asyncio.sleep(WATCH_S)
            why = self.group.lost()
            if why is None and getattr(runner, "is_broken", False):
                why = runner.broken_reason
            if why is not None:
                break
        self.broken = why
        log.error("%s: the EP group broke (%s); failing its requests and ending the node for a restart",
                  getattr(self._node, "name", "node"), why)
        # the step that saw the break has failed its requests; requests waiting for a step fail at
        # the next one: give them a moment to be answered, then leave
        deadline = time.monotonic() + FAIL_GRACE_S
        loop = self.service.loop
        while loop is not None and loop.num_requests and time.monotonic() < deadline:
            loop.wake()
            await asyncio.sleep(WATCH_S)
        # a clean stop says goodbye to the peers (they mark this instance down at once); whatever
        # it waits on (a device thread in a dead collective), the process leaves after the grace
        stopping = asyncio.get_running_loop().create_task(self._node.stop(), name="ep-node-stop")
        await asyncio.wait({stopping}, timeout=FAIL_GRACE_S)
        if stopping.done() and not stopping.cancelled() and stopping.exception() is not None:
            log.error("stopping the node after the EP group broke: %r", stopping.exception())
        logging.shutdown()
        self._exit(EXIT_GROUP_BROKEN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
