"""StoreHealth (engine/kv/store_health.py), the KV store back-off policy, on a fake clock: a failure
starts an outage (one warning), calls are skipped until the back-off passes, one probe goes
through, a failing probe doubles the back-off up to the cap, an answer ends the outage (one info)."""

from __future__ import annotations

import logging

from deepinfer.engine.kv.store_health import StoreHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_probe_and_recovery(caplog):
    caplog.set_level(logging.DEBUG, logger="deepinfer.engine.kv.store_health")
    clock = Clock()
    health = StoreHealth(min_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    assert health.can_try() and health.can_try() and not health.is_out
    health.on_failure("read timed out")
    assert health.is_out and not health.can_try()
    clock.now += 0.99
    assert not health.can_try()
    clock.now += 0.02
    assert health.can_try()  # the probe
    assert not health.can_try()  # only one per back-off
    backoffs = []
    for _ in range(4):  # the probe fails again and again: 2, 4, 4, 4 s
        health.on_failure("read timed out")
        start = clock.now
        while not health.can_try():
            clock.now += 0.25
        backoffs.append(clock.now - start)
    assert backoffs == [2.0, 4.0, 4.0, 4.0]
    health.on_answer()
    assert not health.is_out and health.can_try() and health.can_try()
    assert health.num_outages == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "kv store unavailable: read timed out" in warnings[0].getMessage()
    assert len(infos) == 1 and "answers again" in infos[0].getMessage()
    health.on_answer()  # already healthy: nothing more to say
    health.on_failure("write failed")  # a new outage: a new warning, back-off from the start
    assert health.num_outages == 2 and not health.can_try()
    clock.now += 1.0
    assert health.can_try()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_writes_back_off_on_their_own_so_reads_never_flap_with_them(caplog):
    # a cluster with k nodes up: reads answer, every write fails (quorum k+1 unreachable)
    caplog.set_level(logging.INFO, logger="deepinfer.engine.kv.store_health")
    clock = Clock()
    health = StoreHealth(min_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    for _ in range(5):
        health.on_write_failure("no block of a 4-block write-behind was stored")
        health.on_answer()  # a read hit in between
        assert health.can_try() and not health.is_out  # reads never stop
        assert health.is_write_out and not health.can_write()
        clock.now += 0.5
    assert health.num_write_outages == 1 and health.num_outages == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "does not take writes" in messages[0]  # one warning, no "answers again"
    clock.now += 10
    assert health.can_write()  # the probe
    health.on_write_answer()
    assert not health.is_write_out and "takes writes again" in caplog.records[-1].getMessage()
