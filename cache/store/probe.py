"""Which storage nodes answer: one stats request to each, for a start-up line in the logs.

    probe = await probe_cluster(store, timeout_s=2.0)
    probe.is_usable      # at least k nodes answered: objects can be written and read
    probe.describe()     # "2 of 6 storage nodes did not answer within 2 s: node-03 (tcp://...), ..."
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterProbe:
    num_nodes: int
    k: int
    silent: dict[str, str]  # node name -> address, of the nodes that did not answer
    timeout_s: float

    @property
    def is_usable(self) -> bool:
        return self.num_nodes - len(self.silent) >= self.k

    def describe(self) -> str:
        if not self.silent:
            return f"all {self.num_nodes} storage nodes answered"
        names = ", ".join(f"{n} ({a})" for n, a in sorted(self.silent.items()))
        return f"{len(self.silent)} of {self.num_nodes} storage nodes did not answer within {self.timeout_s:g} s: {names}"


async def probe_cluster(store, timeout_s: float = 2.0) -> ClusterProbe:
    """``store``: a started ClusterStore (client.py)."""
    node2stats = await store.node_stats(timeout_s)
    silent = {n: store.address_of(n) for n, s in node2stats.items() if s is None}
    return ClusterProbe(len(node2stats), store.config.ec.k, silent, timeout_s)
