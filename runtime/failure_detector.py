"""When a silent peer becomes a *suspect*: a phi-accrual detector over heartbeat arrival times.

A fixed "N missed beats" rule cannot tell a dead peer from a live one on a busy host: a 2-core
machine running three engines stalls a process (or the observer itself) for longer than 3 x
0.2 s now and then, and every such stall used to kill healthy work. Instead, per peer:

- the intervals between its heartbeats are kept (the last ``window`` of them); their mean and
  standard deviation describe how regular this peer is *as observed here*, including the jitter
  of a loaded host;
- ``phi(silence) = -log10 P(interval > silence)`` under a normal model of those intervals: phi 8
  means "a silence this long happens once in 10^8 intervals of this peer" (Hayashibara et al.,
  "The phi accrual failure detector", 2004);
- the peer is suspected when ``phi >= suspect_phi`` — never before ``min_silence_s`` (a stall any
  host may have), always by ``max_silence_s`` (the bound on detecting a truly dead peer).

Suspicion is not death: the driver (runtime/peer_monitor.py) then asks the peer directly and
declares it down only when that probe goes unanswered for ``probe_timeout_s``
(``probe_timeout_s = 0``: suspicion is death). A dead peer is therefore declared down at most
``max_silence_s + probe_timeout_s`` (plus one sweep) after its last sign of life.

Pure: plain floats in, decisions out; the clock is the caller's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_SUSPECT_PHI = 8.0
DEFAULT_MIN_SILENCE_S = 2.0
DEFAULT_MAX_SILENCE_S = 5.0
DEFAULT_PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """How long a silence may last before a peer is suspected, and how a suspect is confirmed.

    Defaults (why): a busy 2-core host stalls processes for about a second now and then, so a
    peer is never suspected before 2 s of silence and a probe gets 1 s to be answered: a stall
    shorter than ~3 s never kills healthy work, longer ones only when the peer is as irregular as
    it has never been. A dead peer is declared down within 5 + 1 s at worst, ~3 s when its beats
    were regular (the steady case: phi passes 8 well before the 2 s floor)."""

    interval_s: float = 0.5  # the heartbeat interval peers publish at: the prior before any samples
    suspect_phi: float = DEFAULT_SUSPECT_PHI
    min_silence_s: float = DEFAULT_MIN_SILENCE_S
    max_silence_s: float = DEFAULT_MAX_SILENCE_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S  # 0: no probe, suspicion is death
    window: int = 100  # intervals remembered per peer

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {self.interval_s}")
        if not self.suspect_phi > 0:
            raise ValueError(f"suspicion threshold phi must be > 0, got {self.suspect_phi}")
        if not 0 < self.min_silence_s <= self.max_silence_s:
            raise ValueError(f"need 0 < min silence <= max silence, got {self.min_silence_s} and "
                             f"{self.max_silence_s} seconds")
        if self.max_silence_s < self.interval_s:
            raise ValueError(f"max silence ({self.max_silence_s} s) must be at least one heartbeat interval "
                             f"({self.interval_s} s)")
        if self.probe_timeout_s < 0:
            raise ValueError(f"probe timeout must be >= 0 seconds (0: no probe), got {self.probe_timeout_s}")
        if self.window < 2:
            raise ValueError(f"window must hold >= 2 intervals, got {self.window}")

    @property
    def min_std_s(self) -> float:
        """Floor of the interval spread: a perfectly regular history is not a promise (a quarter
        interval, as the detector's paper and Akka's defaults suggest for LAN heartbeats)."""
        return self.interval_s / 4

    @property
    def max_detection_s(self) -> float:
        """Worst-case silence before a dead peer is declared down (excluding the sweep period)."""
        return self.max_silence_s + self.probe_timeout_s


def detector_settings(*, interval_s: float, missed_beats: int = 0, suspect_phi: float = DEFAULT_SUSPECT_PHI,
                      min_silence_s: float = DEFAULT_MIN_SILENCE_S, max_silence_s: float = DEFAULT_MAX_SILENCE_S,
                      probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> DetectorSettings:
    """Settings from a cluster config's keys. ``missed_beats`` (the old fixed rule) still counts
    as a floor in beats: a config that tolerated 20 silent beats keeps tolerating them (and the
    cap rises with it), one with 3 x 0.2 s gets the ``min_silence_s`` floor instead."""
    beats_s = missed_beats * interval_s
    return DetectorSettings(interval_s=interval_s, suspect_phi=suspect_phi, min_silence_s=max(min_silence_s, beats_s),
                            max_silence_s=max(max_silence_s, beats_s), probe_timeout_s=probe_timeout_s)


class ArrivalWindow:
    """The last ``window`` inter-arrival intervals of one peer's heartbeats."""

    __slots__ = ("_settings", "_intervals", "_sum", "_sum_sq", "last_arrival")

    def __init__(self, settings: DetectorSettings):
        self._settings = settings
        self._intervals: deque[float] = deque()
        self._sum = 0.0
        self._sum_sq = 0.0
        self.last_arrival: float | None = None

    @property
    def num_intervals(self) -> int:
        return len(self._intervals)

    def record(self, now: float) -> None:
        """A heartbeat arrived at ``now``."""
        if self.last_arrival is not None:
            interval = max(0.0, now - self.last_arrival)
            self._intervals.append(interval)
            self._sum += interval
            self._sum_sq += interval * interval
            if len(self._intervals) > self._settings.window:
                old = self._intervals.popleft()
                self._sum -= old
                self._sum_sq -= old * old
        self.last_arrival = now

    def mean_std(self) -> tuple[float, float]:
        """(mean, std) of the intervals, the configured interval until two samples exist."""
        n = len(self._intervals)
        floor = self._settings.min_std_s
        if n < 2:
            return self._settings.interval_s, floor
        mean = self._sum / n
        var = max(0.0, self._sum_sq / n - mean * mean)
        return mean, max(math.sqrt(var), floor)

    def phi(self, silence_s: float) -> float:
        """-log10 of the probability that this peer's next beat comes later than ``silence_s``."""
        mean, std = self.mean_std()
        p_later = 0.5 * math.erfc((silence_s - mean) / (std * math.sqrt(2.0)))
        return math.inf if p_later <= 0.0 else -math.log10(p_later)


def is_suspect(settings: DetectorSettings, arrivals: ArrivalWindow, silence_s: float) -> bool:
    """Whether a peer silent for ``silence_s`` (since its last sign of life) is suspected."""
    if silence_s >= settings.max_silence_s:
        return True
    if silence_s < settings.min_silence_s:
        return False
    return arrivals.phi(silence_s) >= settings.suspect_phi
