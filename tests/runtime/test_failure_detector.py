"""The failure-detector policy with a fake clock: fabricated heartbeat arrival times in, suspicion
and PeerUp/PeerDown out (runtime/failure_detector.py, runtime/peer_table.py)."""

import random

import pytest

from deepinfer.runtime.failure_detector import ArrivalWindow, DetectorSettings, detector_settings, is_suspect
from deepinfer.runtime.peer_table import PeerTable, ProbeRequest
from deepinfer.transport.protocol import DownReason, Heartbeat, PeerDown, PeerUp, Role

LOCAL = DetectorSettings(interval_s=0.2)  # the local P/D cluster's interval, default thresholds
SWEEP_S = LOCAL.interval_s / 2


def beat(instance=1, seq=1, name="d"):
    return Heartbeat(node_name=name, role=Role.DECODE, instance_id=instance, seq=seq)


class Driver:
    """Feeds a PeerTable heartbeat arrival times and sweeps it every half interval, as
    PeerMonitor does. A probe is answered ``probe_delay_s`` after it is sent once the peer runs
    (from ``alive_after``; None: never), else it fails at the probe timeout."""

    def __init__(self, settings=LOCAL):
        self.table = PeerTable(settings)
        self.events: list[tuple[float, object]] = []  # (when, PeerUp/PeerDown)
        self.probes: list[ProbeRequest] = []
        self._next_sweep = SWEEP_S

    def run_until(self, t_end, arrivals, *, alive_after=None, probe_delay_s=0.05):
        timeout_s = self.table.settings.probe_timeout_s
        pending = sorted(arrivals)
        results: list[tuple[float, ProbeRequest, bool]] = []  # (when, probe, answered)
        while True:
            when = min([self._next_sweep] + pending[:1] + [r[0] for r in results])
            if when > t_end:
                return
            if pending and when == pending[0]:
                pending.pop(0)
                self._record(when, self.table.observe(beat(), when))
            elif results and when == min(r[0] for r in results):
                results.sort(key=lambda r: r[0])
                _, probe, answered = results.pop(0)
                self._record(when, self.table.probe_answered(probe, probe.instance_id, when) if answered
                             else self.table.probe_failed(probe, when))
            else:
                self._next_sweep += SWEEP_S
                sweep = self.table.sweep(when)
                self._record(when, sweep.events)
                for probe in sweep.probes:
                    self.probes.append(probe)
                    answer_at = None if alive_after is None else max(when + probe_delay_s, alive_after)
                    if answer_at is not None and answer_at < when + timeout_s:
                        results.append((answer_at, probe, True))
                    else:
                        results.append((when + timeout_s, probe, False))

    def _record(self, when, events):
        self.events += [(when, e) for e in events]

    def downs(self):
        return [(when, e) for when, e in self.events if isinstance(e, PeerDown)]


def jittery_arrivals(seed, until, *, gap_prob, gap_s, interval=0.2):
    """Beats every ``interval`` +-40 %; with probability ``gap_prob`` a gap of ``gap_s`` (a
    stalled sender or observer) followed by the beats queued meanwhile, stamped in a burst."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < until:
        if rng.random() < gap_prob:
            gap = rng.uniform(*gap_s)
            t += gap
            out += [t + 0.001 * k for k in range(int(gap / interval))]
            t = out[-1]
        else:
            t += interval * rng.uniform(0.6, 1.4)
            out.append(t)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_jittery_but_alive_peer_is_never_suspected(seed):
    """Stalls of 0.6-1.8 s (1 to 3 times the old 0.6 s death sentence) every few seconds."""
    arrivals = jittery_arrivals(seed, until=120.0, gap_prob=0.04, gap_s=(0.6, 1.8))
    driver = Driver()
    driver.run_until(arrivals[-1], arrivals, alive_after=0.0)
    assert driver.events == [(arrivals[0], PeerUp("d", Role.DECODE, 1))]
    assert driver.probes == []


@pytest.mark.parametrize("seed", range(3))
def test_irregular_peer_is_seldom_suspected_once_its_spread_is_known(seed):
    """Gaps of 2.5-3.2 s, past the 2 s floor, one beat in ten: a floor-only rule probes every
    one of them; phi, having seen them, probes few (and a live answer keeps the peer up)."""
    arrivals = jittery_arrivals(seed, until=120.0, gap_prob=0.1, gap_s=(2.5, 3.2))
    floor_only = Driver(DetectorSettings(interval_s=0.2, suspect_phi=1e-9))
    floor_only.run_until(arrivals[-1], arrivals, alive_after=0.0)
    adaptive = Driver()
    adaptive.run_until(arrivals[-1], arrivals, alive_after=0.0)
    num_long_gaps = sum(b - a > LOCAL.min_silence_s + SWEEP_S for a, b in zip(arrivals, arrivals[1:]))
    assert len(floor_only.probes) >= num_long_gaps >= 15
    assert 1 <= len(adaptive.probes) <= len(floor_only.probes) / 3
    assert adaptive.downs() == [] and floor_only.downs() == []


@pytest.mark.parametrize("stall_s", [0.7, 1.2, 1.8])
def test_stall_longer_than_the_old_threshold_is_not_even_suspected(stall_s):
    """3 x 0.2 s was the old rule; a sender stall under the 2 s floor raises no suspicion at all."""
    arrivals = [0.2 * k for k in range(1, 51)]  # steady to 10 s
    arrivals += [10.0 + stall_s + 0.2 * k for k in range(80)]  # beating again past the end
    driver = Driver()
    driver.run_until(25.0, arrivals)  # probes would go unanswered: alive_after=None
    assert driver.probes == [] and driver.downs() == []


def test_a_longer_stall_is_probed_and_a_live_answer_keeps_the_peer_up():
    arrivals = [0.2 * k for k in range(1, 51)] + [12.6 + 0.2 * k for k in range(20)]  # 2.6 s stall
    driver = Driver()
    driver.run_until(16.0, arrivals, alive_after=12.5)  # answers the probe once it runs again
    assert [p.sent_at for p in driver.probes] == [pytest.approx(10.0 + LOCAL.min_silence_s, abs=SWEEP_S + 1e-6)]
    assert driver.downs() == []
    assert driver.table.is_up("d") and not driver.table.is_suspected("d")


def test_probe_unanswered_but_a_beat_arrived_meanwhile_is_no_death():
    """The observer was the slow one: its probe timed out, yet a beat got through after it was sent."""
    table = PeerTable(LOCAL)
    table.observe(beat(), 0.0)
    probe = table.sweep(2.5).probes[0]
    assert table.is_suspected("d")
    table.observe(beat(seq=2), 2.7)
    assert not table.is_suspected("d")
    assert table.probe_failed(probe, 3.5) == []
    assert table.is_up("d")


@pytest.mark.parametrize("seed, gap_prob, gap_s", [(0, 0.04, (0.6, 1.8)), (1, 0.1, (2.5, 3.2)),
                                                   (2, 0.3, (3.0, 4.5))])
def test_dead_peer_is_declared_down_within_max_silence_plus_probe_timeout(seed, gap_prob, gap_s):
    arrivals = jittery_arrivals(seed, until=60.0, gap_prob=gap_prob, gap_s=gap_s)
    last = arrivals[-1]
    driver = Driver()
    driver.run_until(last, arrivals, alive_after=0.0)  # alive: answers every probe
    driver.run_until(last + 20.0, [], alive_after=None)  # then killed: silent, probes unanswered
    downs = driver.downs()
    assert [e for _, e in downs] == [PeerDown("d", Role.DECODE, 1, DownReason.MISSED_BEATS)]
    detected_after = downs[0][0] - last
    assert LOCAL.min_silence_s + LOCAL.probe_timeout_s <= detected_after <= LOCAL.max_detection_s + SWEEP_S


def test_dead_peer_with_a_regular_history_is_down_near_the_floor():
    arrivals = [0.2 * k for k in range(1, 101)]
    driver = Driver()
    driver.run_until(40.0, arrivals)
    (down_at, _), = driver.downs()
    floor = LOCAL.min_silence_s + LOCAL.probe_timeout_s
    assert floor <= down_at - arrivals[-1] <= floor + SWEEP_S + 1e-9


def test_phi_adapts_to_the_observed_spread():
    steady, jittery = ArrivalWindow(LOCAL), ArrivalWindow(LOCAL)
    rng = random.Random(3)
    t1 = t2 = 0.0
    for _ in range(100):
        t1 += 0.2
        t2 += rng.choice([0.05, 0.2, 0.2, 1.5])
        steady.record(t1)
        jittery.record(t2)
    assert steady.phi(2.5) > 100 and jittery.phi(2.5) < LOCAL.suspect_phi
    assert is_suspect(LOCAL, steady, 2.5) and not is_suspect(LOCAL, jittery, 2.5)
    assert is_suspect(LOCAL, jittery, LOCAL.max_silence_s)  # the cap holds whatever the history
    assert not is_suspect(LOCAL, steady, LOCAL.min_silence_s - 0.01)  # and so does the floor
    assert steady.phi(0.1) < 1.0  # no silence worth mentioning


def test_probe_answered_by_another_instance_is_a_restart():
    table = PeerTable(LOCAL)
    table.observe(beat(instance=1), 0.0)
    probe = table.sweep(2.5).probes[0]
    assert table.probe_answered(probe, answered_instance_id=2, now=2.6) == [
        PeerDown("d", Role.DECODE, 1, DownReason.RESTARTED)]
    assert table.observe(beat(instance=1, seq=9), 2.7) == []  # the old life stays dead
    assert table.observe(beat(instance=2), 2.8) == [PeerUp("d", Role.DECODE, 2)]


def test_without_probes_suspicion_is_death_and_stale_probe_results_are_ignored():
    table = PeerTable(DetectorSettings(interval_s=0.2, probe_timeout_s=0.0))
    table.observe(beat(), 0.0)
    assert table.sweep(1.9).events == []
    assert table.sweep(2.1).events == [PeerDown("d", Role.DECODE, 1, DownReason.MISSED_BEATS)]
    table = PeerTable(LOCAL)
    table.observe(beat(), 0.0)
    probe = table.sweep(2.1).probes[0]
    assert table.sweep(2.2).probes == []  # one probe at a time
    table.observe(beat(seq=2), 2.3)
    assert table.probe_failed(probe, 3.1) == []  # answered by a beat; the old question is void


def test_settings_validation_and_the_missed_beats_floor():
    with pytest.raises(ValueError, match="min silence <= max silence"):
        DetectorSettings(min_silence_s=3.0, max_silence_s=2.0)
    with pytest.raises(ValueError, match="probe timeout must be >= 0"):
        DetectorSettings(probe_timeout_s=-1)
    assert detector_settings(interval_s=0.2, missed_beats=3).min_silence_s == 2.0  # 0.6 s is below the floor
    wide = detector_settings(interval_s=1.0, missed_beats=20)  # an old config that tolerated 20 s
    assert (wide.min_silence_s, wide.max_silence_s) == (20.0, 20.0)


def test_outside_evidence_probes_at_once_and_only_the_probe_decides():
    table = PeerTable(LOCAL)
    table.observe(beat(), 0.0)
    assert table.sweep(0.3).probes == []  # no silence to speak of
    (probe,) = table.suspect("d", 0.3).probes  # its supervisor saw the process exit
    assert table.suspect("d", 0.4).probes == [] and table.suspect("nobody", 0.4).probes == []
    assert table.probe_failed(probe, 1.3) == [PeerDown("d", Role.DECODE, 1, DownReason.MISSED_BEATS)]
    table = PeerTable(LOCAL)
    table.observe(beat(), 0.0)
    (probe,) = table.suspect("d", 0.3).probes
    assert table.probe_answered(probe, 1, 0.35) == [] and table.is_up("d")  # alive after all
