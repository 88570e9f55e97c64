"""Where an object's fragments live: rendezvous hashing to a coding group; no central master.

    key --blake2b--> placement group g (one of num_groups)
    g   --HRW------> every node ranked by blake2b(node name, g), highest first
    coding group = the first k+m ranked nodes that are up; fragment i goes to the group's i-th node

Any client computes the same answer from the node list alone. Rendezvous ranking moves the
least data when membership changes: adding or removing a node only changes the groups in which
that node ranks among the first k+m. Ranking per placement group (not per key) makes a lookup one
hash plus a cached tuple, whatever the cluster size.

Writes skip nodes that are down, so a fragment may sit on a node further down the ranking than
its index suggests. Fragments name their own index, so readers never need the exact write-time
group: they ask nodes in ranking order (``read_window``) and decode whatever k fragments come back.
Draining nodes (membership.py) take no new fragments but still hold old ones: a read asks them
right after the group's own nodes. Repair (repair.py) moves fragments to where the ranking says
they belong, so after a membership change reads find them in the first wave again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

DEFAULT_NUM_GROUPS = 4096


class PlacementError(ValueError):
    """Not enough nodes (up) to place a coding group."""


def _score(node: str, group: int) -> int:
    digest = hashlib.blake2b(node.encode(), digest_size=8, key=group.to_bytes(8, "little"), person=b"deepinfer-hrw")
    return int.from_bytes(digest.digest(), "little")


class Placement:
    def __init__(self, node_names: Sequence[str], *, num_groups: int = DEFAULT_NUM_GROUPS):
        if len(set(node_names)) != len(node_names):
            raise PlacementError(f"storage node names must be unique, got {list(node_names)}")
        if not node_names:
            raise PlacementError("a placement needs at least one storage node")
        if num_groups < 1:
            raise PlacementError(f"num_groups must be >= 1, got {num_groups}")
        self.node_names = tuple(node_names)
        self.num_groups = num_groups
        self._group2ranking: dict[int, tuple[str, ...]] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def group_of(self, key: bytes) -> int:
        digest = hashlib.blake2b(key, digest_size=8, person=b"deepinfer-pg").digest()
        return int.from_bytes(digest, "little") % self.num_groups

    def ranked(self, key: bytes) -> tuple[str, ...]:
        """Every node, in the key's rendezvous order (up or down)."""
        group = self.group_of(key)
        ranking = self._group2ranking.get(group)
        if ranking is None:
            ranking = tuple(sorted(self.node_names, key=lambda n: (_score(n, group), n), reverse=True))
            self._group2ranking[group] = ranking
        return ranking

    def read_order(self, key: bytes, down: Collection[str] = ()) -> list[str]:
        """Nodes to ask for the key's fragments, most likely holders first, down nodes left out."""
        return [n for n in self.ranked(key) if n not in down]

    def read_window(
        self, key: bytes, n: int, width: int, unusable: Collection[str] = (), draining: Collection[str] = ()
    ) -> tuple[list[str], list[str]]:
        """(nodes to ask in order, unusable nodes ranked among them).

        Order: the first ``n`` usable nodes that are not draining (the coding group, where the
        fragments belong), then draining nodes (old fragments not moved yet), then the rest, up
        to ``width`` nodes in all.
        """
        ranked = self.ranked(key)
        if not unusable and not draining:
            return list(ranked[:width]), []
        group, drain, rest, skipped = [], [], [], []
        for node in ranked:
            if len(group) + len(drain) + len(rest) == width:
                break
            if node in unusable:
                skipped.append(node)
            elif node in draining:
                drain.append(node)
            elif len(group) < n:
                group.append(node)
            else:
                rest.append(node)
        return group + drain + rest, skipped

    def coding_group(self, key: bytes, width: int, down: Collection[str] = (), *, min_width: int | None = None) -> list[str]:
        """The first ``width`` up nodes of the ranking: fragment i goes to element i.

        With fewer up nodes the group shrinks (the trailing parity fragments are not written),
        down to ``min_width`` (default ``width``); below that the placement fails.
        """
        min_width = width if min_width is None else min_width
        group = self.read_order(key, down)[:width]
        if len(group) < min_width:
            raise PlacementError(
                f"{len(group)} of {self.num_nodes} storage nodes are up; a coding group needs {min_width}"
            )
        return group
