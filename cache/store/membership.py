"""The storage cluster's membership record: which nodes exist, where, and in which state.

One small JSON file, the same on every storage node and store client (config management copies
it; ``deepinfer storage members`` edits it and bumps ``epoch``)::

    {"epoch": 4, "ec": "10+2",
     "nodes": [{"name": "node-00", "address": "tcp://10.0.0.7:7600", "state": "up"}, ...]}

States, and what placement does with them (placement.py ranks every node that is not removed):

    up         holds fragments, takes new ones
    draining   still serves what it holds, takes nothing new; its fragments move to the nodes
               that now rank in their groups (repair.py); empty -> safe to remove
    down       known broken (an operator's word): never asked; its fragments are rebuilt elsewhere
    removed    gone from the ranking: its groups now rank other nodes, which repair fills

Nodes and clients re-read the file when it changes (``MembershipFile.poll``); a record with a
lower epoch than the one in use is ignored, so a stale copy never undoes a change.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path


class NodeState(str, enum.Enum):
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"
    REMOVED = "removed"


class MembershipError(ValueError):
    """A membership record that cannot be used; the message says which entry and why."""


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    address: str
    state: NodeState = NodeState.UP


@dataclass(frozen=True, slots=True)
class Membership:
    epoch: int
    members: tuple[Member, ...]
    k: int = 10
    m: int = 2

    @classmethod
    def of(cls, node2address: Mapping[str, str], *, k: int = 10, m: int = 2, epoch: int = 0) -> "Membership":
        return cls(epoch, tuple(Member(n, a) for n, a in sorted(node2address.items())), k, m)

    def __post_init__(self) -> None:
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise MembershipError(f"membership lists a node twice: {sorted(n for n in names if names.count(n) > 1)[0]}")

    @property
    def ranked_names(self) -> list[str]:
        """Nodes placement ranks: every node not removed."""
        return sorted(m.name for m in self.members if m.state != NodeState.REMOVED)

    @property
    def node2address(self) -> dict[str, str]:
        return {m.name: m.address for m in self.members if m.state != NodeState.REMOVED}

    def names_in(self, *states: NodeState) -> set[str]:
        return {m.name for m in self.members if m.state in states}

    def state_of(self, name: str) -> NodeState | None:
        return next((m.state for m in self.members if m.name == name), None)

    def with_state(self, name: str, state: NodeState) -> "Membership":
        if self.state_of(name) is None:
            raise MembershipError(f"no storage node {name!r} in the membership ({', '.join(m.name for m in self.members)})")
        members = tuple(replace(m, state=state) if m.name == name else m for m in self.members)
        return replace(self, epoch=self.epoch + 1, members=members)

    def with_node(self, name: str, address: str) -> "Membership":
        if self.state_of(name) not in (None, NodeState.REMOVED):
            raise MembershipError(f"storage node {name!r} is already a member")
        members = tuple(m for m in self.members if m.name != name) + (Member(name, address),)
        return replace(self, epoch=self.epoch + 1, members=members)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "ec": f"{self.k}+{self.m}",
                           "nodes": [{"name": m.name, "address": m.address, "state": m.state.value} for m in self.members]},
                          indent=1)  # fmt: skip


def parse_membership(text: str, source: str = "membership") -> Membership:
    try:
        raw = json.loads(text)
        epoch, ec, nodes = int(raw["epoch"]), str(raw.get("ec", "10+2")), raw["nodes"]
        k, m = (int(x) for x in ec.split("+"))
    except (ValueError, KeyError, TypeError) as exc:
        raise MembershipError(f"{source}: not a membership record ({{'epoch', 'ec': 'K+M', 'nodes': [...]}}): {exc}") from None
    members = []
    for i, node in enumerate(nodes):
        try:
            members.append(Member(str(node["name"]), str(node["address"]), NodeState(node.get("state", "up"))))
        except (KeyError, TypeError, ValueError):
            raise MembershipError(f"{source}: nodes[{i}] needs name, address and a state of "
                                  f"{', '.join(s.value for s in NodeState)}; got {node!r}") from None
    return Membership(epoch, tuple(members), k, m)


def load_membership(path: str | Path) -> Membership:
    path = Path(path)
    try:
        return parse_membership(path.read_text(), str(path))
    except OSError as exc:
        raise MembershipError(f"cannot read membership file {path}: {exc.strerror}") from None


def save_membership(path: str | Path, membership: Membership) -> None:
    """Write atomically (readers polling the file see the old or the new record, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(membership.to_json())
    os.replace(tmp, path)


class MembershipFile:
    """Re-reads a membership file when it changes; ``poll`` returns a newer record or None."""

    def __init__(self, path: str | Path, current: Membership | None = None):
        self.path = Path(path)
        self.current = current
        self._stamp: tuple[int, int] | None = None

    def poll(self) -> Membership | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            record = load_membership(self.path)
        except MembershipError:
            return None  # a half-edited file by hand: keep the last good record, look again next time
        if self.current is not None and record.epoch <= self.current.epoch and record == self.current:
            return None
        if self.current is not None and record.epoch < self.current.epoch:
            return None
        self.current = record
        return record
