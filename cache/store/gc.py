"""Garbage-collection policy of a storage node: TTL per traffic class, then LRU to a low watermark.

Pure: plain values in, a plan out; the fragment store applies it. Two rules, in this order:

1. **TTL.** Every fragment carries ``expires_at = written_at + ttl(traffic_class)``; once the
   clock passes it the fragment is gone, whatever the fill level. Retention counts from the write,
   not the last read: the TTL is a promise about how long a conversation's KV may live on the
   store, and reading it must not extend that (ARCHITECTURE.md, "KV store": agent 3 days, chat 7 days).
2. **Fill.** When used bytes pass the high watermark, least-recently-used fragments go until used
   bytes are at or below the low watermark. The gap between the two marks keeps GC from running on
   every write once the node is full.

    0 ............................ low ........ high ..... capacity
                                    ^ evict down to here     ^ start when past here
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

DAY_S = 86400.0
DEFAULT_CLASS2TTL_S = {"agent": 3 * DAY_S, "chat": 7 * DAY_S}


@dataclass(frozen=True, slots=True)
class TtlPolicy:
    """Retention per traffic class; a class nobody configured gets ``default_ttl_s``."""

    class2ttl_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_CLASS2TTL_S))
    default_ttl_s: float = 7 * DAY_S

    def __post_init__(self) -> None:
        for name, ttl in {**self.class2ttl_s, "(default)": self.default_ttl_s}.items():
            if not ttl > 0:
                raise ValueError(f"TTL of traffic class {name!r} must be positive, got {ttl}")

    def ttl_s(self, traffic_class: str) -> float:
        return self.class2ttl_s.get(traffic_class, self.default_ttl_s)

    def expires_at(self, traffic_class: str, written_at: float) -> float:
        return written_at + self.ttl_s(traffic_class)


@dataclass(frozen=True, slots=True)
class Watermarks:
    capacity_bytes: int
    high: float = 0.90
    low: float = 0.80

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {self.capacity_bytes} bytes")
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={self.low} high={self.high}")

    @property
    def high_bytes(self) -> int:
        return int(self.capacity_bytes * self.high)

    @property
    def low_bytes(self) -> int:
        return int(self.capacity_bytes * self.low)


class GcEntry(NamedTuple):
    key: Hashable
    num_bytes: int
    expires_at: float


class GcPlan(NamedTuple):
    expired: list  # keys past their TTL
    evicted: list  # keys dropped for space, least recently used first
    num_bytes_freed: int

    @property
    def is_empty(self) -> bool:
        return not self.expired and not self.evicted


def is_expired(expires_at: float, now: float) -> bool:
    return now >= expires_at


def plan_gc(
    by_expiry: Iterable[GcEntry],
    by_recency: Iterable[GcEntry],
    used_bytes: int,
    watermarks: Watermarks,
    now: float,
) -> GcPlan:
    """What to delete now.

    ``by_expiry``: entries in ascending ``expires_at`` (only the expired head is consumed).
    ``by_recency``: entries least recently used first (consumed only while over the low mark,
    and only when ``used_bytes`` is past the high mark).
    """
    expired: list = []
    gone: set = set()
    freed = 0
    for entry in by_expiry:
        if not is_expired(entry.expires_at, now):
            break
        expired.append(entry.key)
        gone.add(entry.key)
        freed += entry.num_bytes
    # TTL deletions count toward the fill target: often they alone bring the node under the mark.
    evicted: list = []
    if used_bytes - freed > watermarks.high_bytes:
        for entry in by_recency:
            if used_bytes - freed <= watermarks.low_bytes:
                break
            if entry.key in gone:
                continue
            evicted.append(entry.key)
            freed += entry.num_bytes
    return GcPlan(expired, evicted, freed)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S}


def parse_duration_s(text: str) -> float:
    """'3d', '12h', '90m', '30s' or plain seconds -> seconds."""
    match = _DURATION.match(text.lower())
    if not match:
        raise ValueError(f"duration {text!r} is not a number with an optional unit s/m/h/d (e.g. 3d)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_ttl_spec(spec: str, base: TtlPolicy | None = None) -> TtlPolicy:
    """'agent=3d,chat=7d[,default=7d]' -> TtlPolicy (classes not named keep ``base``'s TTL)."""
    base = base or TtlPolicy()
    class2ttl = dict(base.class2ttl_s)
    default = base.default_ttl_s
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"TTL item {item!r} is not CLASS=DURATION (e.g. agent=3d)")
        if name.strip() == "default":
            default = parse_duration_s(value)
        else:
            class2ttl[name.strip()] = parse_duration_s(value)
    return TtlPolicy(class2ttl, default)
