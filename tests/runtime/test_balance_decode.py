import pytest

from deepinfer.runtime.balance import DecodeLoad, DecodeStepCost, LeastRequests, RequestInfo, TwoDimDecodeBalancer


def request(num_tokens):
    return RequestInfo(0, num_tokens)


# engine 0: few requests, long caches; engine 1: many requests, short caches
MIXED = [DecodeLoad(0, 10, 3_000_000), DecodeLoad(1, 40, 400_000)]


def test_short_request_goes_where_requests_are_few_even_if_caches_are_long():
    assert TwoDimDecodeBalancer().place(request(500), MIXED).engine_id == 0


def test_long_request_goes_where_caches_are_small_even_if_requests_are_many():
    assert TwoDimDecodeBalancer().place(request(300_000), MIXED).engine_id == 1


def test_one_dimension_alone_gets_one_of_the_two_cases_wrong():
    lr = LeastRequests()
    assert lr.place(request(300_000), MIXED).engine_id == 0  # piles a long request onto 3M KV


def test_choice_is_not_just_the_lower_step_time():
    # engine 1 has the lower step time, yet a short request belongs on engine 0 (few requests)
    cost = DecodeStepCost()
    assert cost.rank_seconds(40, 400_000) < cost.rank_seconds(10, 3_000_000)
    assert TwoDimDecodeBalancer(cost).place(request(200), MIXED).engine_id == 0


def test_full_engines_are_skipped_and_all_full_is_flagged():
    loads = [DecodeLoad(0, 8, 10, max_requests=8), DecodeLoad(1, 30, 10**6, max_requests=64)]
    choice = TwoDimDecodeBalancer().place(request(100), loads)
    assert choice.engine_id == 1 and not choice.is_over_capacity
    no_room = [DecodeLoad(0, 1, 900, kv_capacity_tokens=1000), DecodeLoad(1, 2, 500, kv_capacity_tokens=1000)]
    choice = TwoDimDecodeBalancer().place(request(600), no_room)
    assert choice.is_over_capacity and choice.engine_id == 1  # least over: 1100/1000 vs 1500/1000


def test_empty_group_is_an_error():
    with pytest.raises(ValueError, match="load list is empty"):
        TwoDimDecodeBalancer().place(request(10), [])


def test_cost_model_balanced_step_never_exceeds_the_real_one():
    cost = DecodeStepCost()
    b, k = [10, 40, 0, 25], [3e6, 4e5, 0, 1e6]
    step, balanced = cost.step_and_balanced_seconds(b, k)
    assert balanced <= step
    assert step == pytest.approx(cost.step_seconds(b, k))
    assert balanced == pytest.approx(cost.balanced_step_seconds(b, k))
    assert cost.step_seconds([5, 5], [100, 100]) == pytest.approx(cost.balanced_step_seconds([5, 5], [100, 100]))
    with pytest.raises(ValueError, match="non-negative"):
        DecodeStepCost(c_kv=-1.0)
