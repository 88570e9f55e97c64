import pytest

from deepinfer.runtime.balance import RoundRobin, VEBalancer, VELoad


def test_images_spread_by_pending_tokens_largest_first():
    loads = [VELoad(0, 0), VELoad(1, 500), VELoad(2, 2000)]
    plan = VEBalancer().assign([300, 1024, 800], loads)
    # largest first: 1024 -> 0 (pending 0), 800 -> 1 (500 < 1024), 300 -> 0 (1024 < 1300)
    assert plan.image2engine == (0, 0, 1)


def test_a_busy_instance_gets_nothing_while_others_have_room():
    loads = [VELoad(0, 10_000), VELoad(1, 0), VELoad(2, 0)]
    assert 0 not in VEBalancer().assign([1024, 1024], loads).image2engine


def test_round_robin_keeps_a_request_on_one_instance():
    rr = RoundRobin()
    loads = [VELoad(0, 0), VELoad(1, 0)]
    assert rr.assign([100, 200], loads).image2engine == (0, 0)
    assert rr.assign([100], loads).image2engine == (1,)


def test_no_images_and_bad_inputs():
    assert VEBalancer().assign([], []).image2engine == ()
    with pytest.raises(ValueError, match="positive"):
        VEBalancer().assign([0], [VELoad(0, 0)])
    with pytest.raises(ValueError, match="load list is empty"):
        VEBalancer().assign([10], [])
