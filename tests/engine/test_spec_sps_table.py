"""SpsTable: SPS(B) per request count from a grid of measured step times (engine/spec/sps_table.py)."""

from __future__ import annotations

import pytest

from deepinfer.engine.spec.sps_table import SpsTable


def linear_table() -> SpsTable:
    # t(R, B) = 1 ms + 0.1 ms per request + 0.01 ms per token; drafter 0.5 ms + 0.02 ms per request
    steps = {r: {r * (1 + d): 1e-3 + 1e-4 * r + 1e-5 * r * (1 + d) for d in (0, 1, 3, 5)} for r in (1, 4, 16)}
    drafts = {r: 5e-4 + 2e-5 * r for r in (1, 4, 16)}
    return SpsTable(steps, drafts, max_depth=5)


def test_grid_points_are_the_measurements_plus_the_drafter():
    table = linear_table()
    p = table.profile(4)
    for d in range(6):
        b = 4 * (1 + d)
        want = 1e-3 + 4e-4 + 1e-5 * b + 5e-4 + 8e-5
        assert p.step_seconds(b) == pytest.approx(want, rel=1e-9)


def test_between_grid_points_is_linear_in_requests():
    table = linear_table()
    p = table.profile(10)  # the time model is linear in R and B: interpolation is exact
    for d in range(6):
        b = 10 * (1 + d)
        assert p.step_seconds(b) == pytest.approx(1e-3 + 1e-3 + 1e-5 * b + 5e-4 + 2e-4, rel=1e-9)
    assert table.profile(10) is p  # cached


def test_outside_the_grid_extends_and_never_drops_below_the_fastest_step():
    table = linear_table()
    big = table.profile(40)
    assert big.step_seconds(40) == pytest.approx(1e-3 + 4e-3 + 4e-4 + 5e-4 + 8e-4, rel=1e-9)
    steps = {r: {r: 1e-3 * (1 + r), 2 * r: 2e-3 * (1 + r)} for r in (2, 4)}
    table = SpsTable(steps, {2: 0.0, 4: 0.0}, max_depth=1)
    assert table.profile(1).step_seconds(1) >= 3e-3  # extrapolated below R = 2, floored


def test_round_trip_and_bad_tables(tmp_path):
    table = linear_table()
    path = tmp_path / "sps.json"
    table.save(path)
    again = SpsTable.load(path)
    assert again.profile(7).seconds == table.profile(7).seconds
    with pytest.raises(ValueError, match="same request counts"):
        SpsTable({1: {1: 1e-3}}, {2: 0.0}, max_depth=0)
    with pytest.raises(ValueError, match="not an SPS table"):
        SpsTable.from_json({"step_seconds": {}})
    with pytest.raises(ValueError, match="cannot read"):
        SpsTable.load(tmp_path / "missing.json")


def test_calibration_envelope_drops_noise_that_padding_beats():
    from deepinfer.engine.spec.sps_calibration import padding_envelope

    # R=1 was measured under load (slower than 4 requests of 6 tokens); R=4, L=1 dipped below L=0
    steps = {1: {1: 0.10, 2: 0.02, 6: 0.03}, 4: {4: 0.05, 8: 0.04, 24: 0.06}}
    drafts = {1: 0.2, 4: 0.01}
    env, env_draft = padding_envelope(steps, drafts, [0, 1, 5])
    assert env == {1: {1: 0.02, 2: 0.02, 6: 0.03}, 4: {4: 0.04, 8: 0.04, 24: 0.06}}
    assert env_draft == {1: 0.01, 4: 0.01}
