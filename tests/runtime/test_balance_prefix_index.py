import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.runtime.balance import PrefixIndex


def test_match_reports_leading_blocks_per_engine():
    index = PrefixIndex()
    index.on_stored(0, ["a", "b", "c"])
    index.on_stored(2, ["a", "b"])
    index.on_stored(5, ["a", "b", "c", "d"])
    index.on_stored(7, ["x"])
    assert index.match(["a", "b", "c", "d", "e"]) == {0: 3, 2: 2, 5: 4}
    assert index.match(["x", "b"]) == {7: 1}
    assert index.match(["q"]) == {}
    assert index.match([]) == {}


def test_a_hole_in_the_chain_ends_the_match():
    index = PrefixIndex()
    index.on_stored(1, ["a", "c"])  # "b" never stored: only the first block leads
    assert index.match(["a", "b", "c"]) == {1: 1}


def test_eviction_and_engine_drop():
    index = PrefixIndex()
    index.on_stored(0, ["a", "b", "c"])
    index.on_stored(1, ["a", "b"])
    index.on_evicted(0, ["c"])
    assert index.match(["a", "b", "c"]) == {0: 2, 1: 2}
    index.on_evicted(0, ["zzz"])  # unknown hashes are ignored
    index.drop_engine(1)
    assert index.match(["a", "b"]) == {0: 2}
    assert index.num_blocks(0) == 2 and index.num_blocks(1) == 0
    index.check_integrity()


def test_storing_twice_counts_once():
    index = PrefixIndex()
    index.on_stored(3, [1, 2])
    index.on_stored(3, [2, 3])
    assert index.num_blocks(3) == 3
    index.check_integrity()


def test_negative_engine_id_is_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        PrefixIndex().on_stored(-1, ["a"])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_match_equals_brute_force(seed):
    rng = random.Random(seed)
    index = PrefixIndex()
    engine2set: dict[int, set] = {e: set() for e in range(6)}
    for _ in range(40):
        e = rng.randrange(6)
        hashes = [rng.randrange(12) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.7:
            index.on_stored(e, hashes)
            engine2set[e].update(hashes)
        else:
            index.on_evicted(e, hashes)
            engine2set[e].difference_update(hashes)
    index.check_integrity()
    query = [rng.randrange(12) for _ in range(rng.randint(1, 8))]
    expected = {}
    for e, held in engine2set.items():
        n = 0
        while n < len(query) and query[n] in held:
            n += 1
        if n:
            expected[e] = n
    assert index.match(query) == expected
