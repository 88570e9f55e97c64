from __future__ import annotations

import collections
import os

import pytest

from deepinfer.cache.store.placement import Placement, PlacementError

NODES = [f"store-{i}" for i in range(16)]


def test_groups_are_distinct_deterministic_and_order_independent():
    a = Placement(NODES)
    b = Placement(list(reversed(NODES)))
    for _ in range(200):
        key = os.urandom(16)
        group = a.coding_group(key, 12)
        assert len(set(group)) == 12
        assert group == b.coding_group(key, 12)  # every client computes the same answer


def test_load_spreads_over_nodes():
    p = Placement(NODES)
    counts = collections.Counter()
    for i in range(4000):
        counts.update(p.coding_group(i.to_bytes(8, "little"), 12))
    expected = 4000 * 12 / len(NODES)
    assert all(0.85 * expected < c < 1.15 * expected for c in counts.values()), counts


def test_down_nodes_are_skipped_and_others_keep_their_place():
    p = Placement(NODES)
    key = b"some-object"
    full = p.coding_group(key, 12)
    down = {full[3]}
    group = p.coding_group(key, 12, down)
    assert full[3] not in group and len(group) == 12
    assert group[:3] == full[:3] and group[3:11] == full[4:12]  # one newcomer at the end
    assert p.read_order(key, down)[:12] == group


def test_removing_a_node_moves_only_its_groups():
    before = Placement(NODES)
    after = Placement(NODES[:-1])
    gone = NODES[-1]
    num_moved = 0
    for i in range(2000):
        key = i.to_bytes(4, "little")
        old, new = before.coding_group(key, 12), after.coding_group(key, 12)
        if gone not in old:
            assert old == new
        else:
            num_moved += 1
    assert 0 < num_moved < 2000


def test_too_few_nodes_up_fails_with_a_clear_error_or_shrinks_to_min():
    p = Placement(NODES[:12])
    with pytest.raises(PlacementError, match="11 of 12 storage nodes are up; a coding group needs 12"):
        p.coding_group(b"k", 12, {NODES[0]})
    assert len(p.coding_group(b"k", 12, {NODES[0]}, min_width=11)) == 11
    with pytest.raises(PlacementError, match="unique"):
        Placement(["a", "a"])
