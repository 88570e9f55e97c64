"""What one object needs to be whole and where it belongs: a pure plan from who holds what.

Inputs: the object's *group* (the first k+m usable, non-draining nodes of its ranking: where its
fragments belong now) and the *holdings* reported by the nodes asked (node -> fragment index and
write id). Every node computes the same plan from the same view, so each executes its own part
and nobody coordinates:

    write      the write id with the most fragments (a key written twice keeps its best write)
    lacking    group nodes without a fragment of that write, in ranking order
    moves      fragments of that write on nodes outside the group (draining, a spare used while a
               node was down, a node that a membership change pushed out of the group) go to the
               lacking nodes first: a copy, no decoding           -- done by the holder
    rebuilds   indices nobody holds go to the remaining lacking nodes: decode k, encode
                                                                  -- done by the *leader*, the
                                                                     holder of the lowest index
    drops      copies no longer needed: a second holder of one index (the group member's copy
               is kept), an outsider's fragment of another write  -- done by the holder
               (a moved fragment is deleted by its source once the target has it)
    unplaced   indices that have no lacking node to go to (too few usable nodes): the object stays
               degraded until nodes come back or join

    group   = [A, B, C, D]  (k+m = 4)      holdings: A:0  C:2  X:1 (outside)  Y:2 (outside)
    plan    = move 1 X->B, rebuild 3 ->D (leader A), drop Y (C holds 2 already), unplaced 0

Fewer than k distinct indices: the object is lost (``is_lost``); nothing is planned for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Holding:
    index: int
    write_id: int
    payload_crc: int = 0  # lets a rebuild check that re-encoding reproduces the fragments that exist


@dataclass(slots=True)
class RepairPlan:
    key: bytes
    write_id: int = 0
    leader: str = ""  # node holding the lowest index of the write: it rebuilds
    index2holder: dict[int, str] = field(default_factory=dict)  # one source per index of the write
    index2crc: dict[int, int] = field(default_factory=dict)  # their payload CRCs (0: not reported)
    moves: list[tuple[int, str, str]] = field(default_factory=list)  # (index, from node, to node)
    rebuilds: list[tuple[int, str]] = field(default_factory=list)  # (index, to node)
    drops: list[str] = field(default_factory=list)  # nodes whose fragment of the key is surplus
    num_unplaced: int = 0
    is_lost: bool = False

    @property
    def is_complete(self) -> bool:
        """Every index in the group already: nothing to do but drops."""
        return not (self.moves or self.rebuilds or self.num_unplaced or self.is_lost)

    def actions_of(self, node: str) -> tuple[list[tuple[int, str, str]], list[tuple[int, str]], bool]:
        """(moves, rebuilds, drop?) that ``node`` executes."""
        moves = [m for m in self.moves if m[1] == node]
        rebuilds = self.rebuilds if node == self.leader else []
        return moves, rebuilds, node in self.drops


def plan_repair(key: bytes, k: int, n: int, group: Sequence[str], holdings: Mapping[str, Holding]) -> RepairPlan:
    """``group``: where the object's n fragments belong, in ranking order (may be shorter than n
    when too few nodes are usable); ``holdings``: what each node that answered holds (nodes that
    did not answer must be left out by the caller, and no plan made when a group node is silent)."""
    plan = RepairPlan(key)
    if not holdings:
        plan.is_lost = True
        return plan
    write2count: dict[int, int] = {}
    for h in holdings.values():
        write2count[h.write_id] = write2count.get(h.write_id, 0) + 1
    plan.write_id = max(write2count, key=lambda w: (write2count[w], w))
    in_group = set(group)
    # one source per index: a group member's copy first, then the best-ranked outsider's
    ordered = [g for g in group if g in holdings] + sorted(set(holdings) - in_group)
    index2holder: dict[int, str] = {}
    for node in ordered:
        h = holdings[node]
        if h.write_id != plan.write_id:
            if node not in in_group:
                plan.drops.append(node)  # an outsider's fragment of another write: no one needs it
            continue  # inside the group it is simply overwritten by what the plan puts there
        if not 0 <= h.index < n or h.index in index2holder:
            plan.drops.append(node)  # a second copy of one index (or nonsense)
            continue
        index2holder[h.index] = node
        plan.index2crc[h.index] = h.payload_crc
    plan.index2holder = index2holder
    if len(index2holder) < k:
        plan.is_lost = True
        plan.drops = []
        return plan
    plan.leader = index2holder[min(index2holder)]
    lacking = [g for g in group if g not in index2holder.values()]
    outsiders = sorted((i, node) for i, node in index2holder.items() if node not in in_group)
    missing = [i for i in range(n) if i not in index2holder]
    for target in lacking:
        if outsiders:
            index, source = outsiders.pop(0)
            plan.moves.append((index, source, target))
        elif missing:
            plan.rebuilds.append((missing.pop(0), target))
    plan.num_unplaced = len(missing)
    # outsiders left over (only when the group is short of usable nodes) keep their fragments:
    # each is the one copy of its index
    return plan
