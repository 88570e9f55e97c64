"""What a store client believes about each storage node: unusable (skipped) or suspect (asked last).

    down         the runtime's heartbeats said so (PeerDown), until PeerUp
    excluded     the membership record says down or removed (membership.py)
    unreachable  its probe connection was refused or dropped (reachability.py), until the next
                 successful handshake: a crashed node is skipped within milliseconds
    suspect      this client saw the node fail a request, or straggle while the rest of a read's
                 first wave answered; for ``suspect_s`` seconds it is asked only as a hedge and
                 written to only when there are not enough other nodes. An answer clears it.

Unusable nodes (the first three) are never asked: a read that cannot reach k of its nodes ends at
once as UNAVAILABLE, naming them (``why``). The clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from deepinfer.transport.protocol import PeerDown, PeerUp


class NodeHealth:
    def __init__(
        self,
        nodes: Collection[str],
        suspect_s: float,
        *,
        unreachable: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._nodes = set(nodes)
        self.suspect_s = suspect_s
        self._clock = clock
        self.down: set[str] = set()
        self.excluded: dict[str, str] = {}  # node -> its membership state ("down", ...)
        self.unreachable: Mapping[str, str] = {} if unreachable is None else unreachable  # live view, not a copy
        self._suspect_until: dict[str, float] = {}

    def set_nodes(self, nodes: Collection[str]) -> None:
        self._nodes = set(nodes)
        self.down &= self._nodes

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

    def unusable(self) -> set[str]:
        """Nodes no request should go to now."""
        if not (self.down or self.excluded or self.unreachable):
            return set()
        return self.down | self.excluded.keys() | self.unreachable.keys()

    def why(self, node: str) -> str:
        if node in self.unreachable:
            return self.unreachable[node]
        if node in self.excluded:
            return f"marked {self.excluded[node]}"
        if node in self.down:
            return "down (heartbeats)"
        return "failed a request"

    def write_skips(self, width: int) -> set[str]:
        """Nodes a write should avoid: unusable and suspect ones, unless that leaves fewer than
        ``width`` nodes (suspicion must not fail a write that every live node could take)."""
        unusable = self.unusable()
        skip = unusable | self.suspects()
        return skip if len(self._nodes - skip) >= width else unusable
