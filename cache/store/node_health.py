"""What a store client believes about each storage node: down (heartbeats) or suspect (its own eyes).

    down      the runtime's heartbeats said so (PeerDown); skipped by reads and writes until PeerUp
    suspect   this client saw the node fail a request, or straggle while the rest of a read's
              first wave answered; for ``suspect_s`` seconds it is asked only as a hedge and
              written to only when there are not enough other nodes. An answer clears it.

Suspicion bridges the seconds between a crash and the heartbeat verdict, so a dead node costs
one hedge delay per ``suspect_s``, not one per read. The clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from deepinfer.transport.protocol import PeerDown, PeerUp


class NodeHealth:
    def __init__(self, nodes: Collection[str], suspect_s: float, *, clock: Callable[[], float] = time.monotonic):
        self._nodes = frozenset(nodes)
        self.suspect_s = suspect_s
        self._clock = clock
        self.down: set[str] = set()
        self._suspect_until: dict[str, float] = {}

    def mark_down(self, node: str) -> None:
        if node in self._nodes:  # other roles' PeerDowns arrive too
            self.down.add(node)

    def mark_up(self, node: str) -> None:
        self.down.discard(node)
        self._suspect_until.pop(node, None)

    def on_peer_event(self, event) -> None:
        """Heartbeat listener: PeerDown -> down, PeerUp -> up."""
        if isinstance(event, PeerDown):
            self.mark_down(event.node_name)
        elif isinstance(event, PeerUp):
            self.mark_up(event.node_name)

    def suspect(self, node: str) -> None:
        self._suspect_until[node] = self._clock() + self.suspect_s

    def clear(self, node: str) -> None:
        self._suspect_until.pop(node, None)

    def suspects(self) -> set[str]:
        now = self._clock()
        return {n for n, until in self._suspect_until.items() if until > now}

    def write_skips(self, width: int) -> set[str]:
        """Nodes a write should avoid: down and suspect ones, unless that leaves fewer than
        ``width`` nodes (suspicion must not fail a write that every live node could take)."""
        skip = self.down | self.suspects()
        return skip if len(self._nodes) - len(skip) >= width else set(self.down)
