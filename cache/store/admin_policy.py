"""Who may send a storage node its admin messages (RunGc, DebugSet, ScrubNow): a pure policy.

Fragment traffic (put, get, touch, stats, the repair protocol) is open to every peer that can
connect; admin messages change what the node holds or how it behaves, so:

    CURVE on   the peer must be authenticated as an admin: the node's ZAP handler admitted its
               public key (libzmq then names it in the connection's User-Id) and that key is one
               of ``admin_keys`` (empty: nobody; a node that admits any CURVE client for
               fragment traffic still knows no one as an admin).
    CURVE off  the peer must connect from loopback (127.0.0.1 or ::1; ipc:// is local by
               construction) or from one of ``networks`` ("10.0.0.0/8", "any").

A peer that dials another address of the same host (its LAN address, 127.0.0.2) arrives from
that address and counts as remote: only the two canonical loopback addresses are trusted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass

LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class AdminPolicy:
    networks: tuple[str, ...] = ()  # CIDRs besides loopback allowed without CURVE; "any" = all
    is_curve: bool = False
    admin_keys: frozenset[bytes] = frozenset()  # with CURVE: these (Z85) public keys; empty = nobody

    def __post_init__(self) -> None:
        for net in self.networks:
            if net != "any":
                try:
                    ipaddress.ip_network(net, strict=False)
                except ValueError:
                    raise ValueError(f"admin network {net!r} is not a CIDR like 10.0.0.0/8 (or 'any')") from None

    def refusal(self, peer_address: str | None, user_id: str | None) -> str:
        """Why this peer may not administer the node ('' when it may)."""
        if self.is_curve:
            if not user_id:
                return "admin messages need a CURVE client the node's key list admitted"
            if user_id.encode() not in self.admin_keys:
                return f"CURVE key {user_id} is not an admin key of this node (storage --curve-client-keys)"
            return ""
        if peer_address is None or peer_address in LOOPBACK:
            return ""  # ipc/inproc carry no peer address: local by construction
        if "any" in self.networks or _in_any(peer_address, self.networks):
            return ""
        allowed = ", ".join((*LOOPBACK, *self.networks))
        return f"admin messages are accepted only from {allowed}, not from {peer_address} (storage --admin-from)"


def _in_any(address: str, networks: Collection[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(net, strict=False) for net in networks)


def parse_networks(text: str) -> tuple[str, ...]:
    """'10.0.0.0/8,192.168.1.7' or 'any' -> a tuple for AdminPolicy.networks."""
    nets = tuple(n.strip() for n in text.split(",") if n.strip())
    AdminPolicy(networks=nets)  # validates
    return nets
