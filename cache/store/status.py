"""``deepinfer storage status``: the cluster as its nodes see it, one line per node.

    node     state     reach  fragments  used/capacity      short  repaired  moved  scrub_err  audit  epoch
    node-00  up        yes         2041  18.2 MiB/1.0 GiB       0       130      0          0   100%      4
    node-03  draining  yes          310  ...

``short`` is the node's count of objects it knows to be short of k+m fragments and is working on
(an object can count on up to m+1 nodes: each one that audits it); ``epoch`` is the membership
record the node uses (a node behind the file's epoch has not re-read it yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.cache.store.membership import Membership
from deepinfer.transport.protocol import StorageStats


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    membership: Membership
    node2stats: dict[str, StorageStats | None]  # None: did not answer

    @property
    def num_fragments(self) -> int:
        return sum(s.num_fragments for s in self.node2stats.values() if s is not None)

    @property
    def num_silent(self) -> int:
        return sum(s is None for s in self.node2stats.values())

    def fragment_spread(self) -> float:
        """(max - min) / mean fragment count over the up nodes that answered (0: perfectly even)."""
        up = [self.node2stats[m.name] for m in self.membership.members if m.state.value == "up"]
        counts = [s.num_fragments for s in up if s is not None]
        if not counts or not sum(counts):
            return 0.0
        return (max(counts) - min(counts)) / (sum(counts) / len(counts))

    def format(self) -> str:
        rows = [("node", "state", "reach", "fragments", "used/capacity", "short", "repaired", "moved",
                 "scrub_err", "audit", "epoch")]  # fmt: skip
        for member in self.membership.members:
            s = self.node2stats.get(member.name)
            if s is None:
                rows.append((member.name, member.state.value, "no", *["-"] * 8))
                continue
            rows.append((member.name, member.state.value, "yes", str(s.num_fragments),
                         f"{_size(s.used_bytes)}/{_size(s.capacity_bytes)}", str(s.num_under_replicated),
                         str(s.num_repaired), str(s.num_moved), str(s.num_scrub_errors),
                         f"{s.audit_progress:.0%}" if s.membership_epoch >= 0 else "off", str(s.membership_epoch)))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        m = self.membership
        lines.append(f"membership epoch {m.epoch}, EC {m.k}+{m.m}: {self.num_fragments} fragments on "
                     f"{len(self.node2stats) - self.num_silent} answering nodes ({self.num_silent} silent); "
                     f"spread over up nodes {self.fragment_spread():.1%}")  # fmt: skip
        return "\n".join(lines)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"


async def cluster_status(membership: Membership, timeout_s: float = 2.0) -> ClusterStatus:
    from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
    from deepinfer.cache.store.ec import ECConfig

    config = ClusterStoreConfig(ec=ECConfig(membership.k, membership.m), probe_nodes=False)
    async with ClusterStore(membership, config) as store:
        node2stats = await store.node_stats(timeout_s)
    return ClusterStatus(membership, {m.name: node2stats.get(m.name) for m in membership.members})
