"""Every node of one host in one process: ``deepinfer node --cluster FILE --host NAME``.

    host = HostNodes()
    host.add(settings, role)          # one runtime.node.Node per node the cluster file puts on the host
    host.install_signal_handlers()    # SIGTERM/SIGINT: drain all at once; a second one: stop all now
    await host.start()                # in file order; a node that fails to start stops those started
    await host.wait_stopped()         # until every node stopped (a node drained by its control
                                      # channel stops alone, the others keep serving)

Each node keeps its own sockets, instance id and heartbeats, exactly as if it ran alone; they
share the process's event loop (one loop per process, ARCHITECTURE.md "Processes and roles").
"""

from __future__ import annotations

import asyncio
import logging
import signal

from deepinfer.runtime.node import Node, NodeSettings, Role

log = logging.getLogger(__name__)


class HostNodes:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._signal_count = 0
        self._stop_task: asyncio.Future | None = None

    def add(self, settings: NodeSettings, role: Role) -> Node:
        node = Node(settings, [role])
        self.nodes.append(node)
        return node

    async def start(self) -> None:
        started: list[Node] = []
        try:
            for node in self.nodes:
                await node.start()
                started.append(node)
        except BaseException:
            for node in reversed(started):
                await node.stop()
            raise

    async def wait_stopped(self) -> None:
        await asyncio.gather(*(node.wait_stopped() for node in self.nodes))

    async def drain(self) -> None:
        await asyncio.gather(*(node.drain() for node in self.nodes), return_exceptions=True)

    async def stop_when_started(self) -> None:
        await asyncio.gather(*(node.stop_when_started() for node in self.nodes), return_exceptions=True)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signal_count += 1
        names = ", ".join(node.name for node in self.nodes)
        if self._signal_count == 1:
            log.info("%s: draining %s", sig.name, names)
            self._stop_task = asyncio.ensure_future(self.drain())
        else:
            log.warning("second %s: stopping %s now", sig.name, names)
            if self._stop_task is not None:
                self._stop_task.cancel()
            asyncio.ensure_future(self.stop_when_started())
