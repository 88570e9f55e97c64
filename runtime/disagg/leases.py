"""Leases on the KV a prefill engine holds for handoffs in flight: a pure table, no clock.

A prefill holds a request's exported KV from the end of its prefill until the decode engine
acknowledges the import. The copy is only worth keeping while that decode engine *instance* is
alive and working on it, so each hold is a lease:

- granted for ``lease_s`` when the push starts,
- renewed by the decode engine (``PdLeaseRenew``, a few times per lease while it waits for room),
- released at once on the ack, on an explicit abort, on the decode instance's PeerDown, or when
  it expires — whichever comes first. Expiry and peer loss are returned to the caller, which
  cancels the push and tells the gateway (never a silent timeout).

Renewals name the decode instance: a restarted decode engine cannot extend its old life's
leases.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    handoff_id: int
    request_id: str
    decode_name: str
    decode_instance_id: int
    num_bytes: int
    expires_at: float


class LeaseTable:
    def __init__(self, lease_s: float):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._id2lease: dict[int, Lease] = {}

    @property
    def num_held(self) -> int:
        return len(self._id2lease)

    @property
    def held_bytes(self) -> int:
        return sum(lease.num_bytes for lease in self._id2lease.values())

    def grant(self, handoff_id: int, request_id: str, decode_name: str, decode_instance_id: int,
              num_bytes: int, now: float) -> Lease:
        assert handoff_id not in self._id2lease, f"handoff {handoff_id} already holds a lease"
        lease = Lease(handoff_id, request_id, decode_name, decode_instance_id, num_bytes, now + self.lease_s)
        self._id2lease[handoff_id] = lease
        return lease

    def renew(self, handoff_ids: list[int], decode_instance_id: int, now: float, lease_s: float | None = None) -> int:
        """Extend the leases of ``handoff_ids`` held for that decode instance; returns how many."""
        until = now + (self.lease_s if lease_s is None else min(lease_s, 4 * self.lease_s))
        num = 0
        for handoff_id in handoff_ids:
            lease = self._id2lease.get(handoff_id)
            if lease is not None and lease.decode_instance_id == decode_instance_id:
                lease.expires_at = max(lease.expires_at, until)
                num += 1
        return num

    def release(self, handoff_id: int) -> Lease | None:
        return self._id2lease.pop(handoff_id, None)

    def take_expired(self, now: float) -> list[Lease]:
        gone = [lease for lease in self._id2lease.values() if lease.expires_at <= now]
        for lease in gone:
            del self._id2lease[lease.handoff_id]
        return gone

    def take_peer(self, decode_name: str, decode_instance_id: int | None = None) -> list[Lease]:
        """Leases held for a decode engine (one instance, or any when None) that went away."""
        gone = [lease for lease in self._id2lease.values() if lease.decode_name == decode_name
                and (decode_instance_id is None or lease.decode_instance_id == decode_instance_id)]
        for lease in gone:
            del self._id2lease[lease.handoff_id]
        return gone

    def take_request(self, request_id: str) -> list[Lease]:
        gone = [lease for lease in self._id2lease.values() if lease.request_id == request_id]
        for lease in gone:
            del self._id2lease[lease.handoff_id]
        return gone
