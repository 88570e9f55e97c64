import pytest

from deepinfer.runtime.balance import DecodeLoad, DecodeLoadView, PrefillLoad, PrefillLoadView


def test_prefill_view_ages_reports_and_adds_own_routing():
    view = PrefillLoadView()
    view.on_report(10.0, PrefillLoad(0, 3, 4.0))
    view.on_report(10.0, PrefillLoad(1, 0, 0.0))
    view.on_routed(10.2, 1, 0.7)
    view.on_routed(10.3, 1, 0.5)
    got = {load.engine_id: load for load in view.loads(11.0)}
    assert got[0].backlog_s == pytest.approx(3.0) and got[0].num_requests == 3
    assert got[1].backlog_s == pytest.approx(1.2) and got[1].num_requests == 2
    assert {load.engine_id: load for load in view.loads(20.0)}[0].backlog_s == 0.0


def test_prefill_view_forgets_routing_a_newer_report_covers():
    view = PrefillLoadView()
    view.on_report(0.0, PrefillLoad(0, 0, 0.0))
    view.on_routed(0.05, 0, 2.0)
    view.on_routed(0.15, 0, 1.0)
    view.on_report(0.1, PrefillLoad(0, 1, 2.0))  # includes the first routed request
    (load,) = view.loads(0.2)
    assert load.num_requests == 2 and load.backlog_s == pytest.approx(1.9 + 1.0)
    view.drop_engine(0)
    assert view.loads(0.3) == []


def test_decode_view_adds_assigned_requests_until_reported():
    view = DecodeLoadView()
    view.on_report(0.0, DecodeLoad(0, 5, 1000, 64, 10**6))
    view.on_routed(0.01, 0, 300)
    (load,) = view.loads()
    assert (load.num_requests, load.num_kv_tokens, load.max_requests) == (6, 1300, 64)
    view.on_report(0.1, DecodeLoad(0, 6, 1300, 64, 10**6))
    assert view.loads()[0].num_requests == 6
