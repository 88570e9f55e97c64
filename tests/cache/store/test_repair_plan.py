"""plan_repair: the pure policy behind repair, moves and drops."""

from __future__ import annotations

from deepinfer.cache.store.repair_plan import Holding, plan_repair


def _h(**node2index):
    return {node: Holding(index, write_id=7) for node, index in node2index.items()}


def test_docstring_example():
    plan = plan_repair(b"k", 2, 4, ["A", "B", "C", "D"], _h(A=0, C=2, X=1, Y=2))
    assert plan.moves == [(1, "X", "B")] and plan.rebuilds == [(3, "D")]
    assert plan.leader == "A" and plan.drops == ["Y"] and plan.num_unplaced == 0
    assert plan.actions_of("X") == ([(1, "X", "B")], [], False)
    assert plan.actions_of("A") == ([], [(3, "D")], False)
    assert plan.actions_of("Y") == ([], [], True)


def test_whole_object_needs_nothing():
    group = [f"n{i}" for i in range(12)]
    plan = plan_repair(b"k", 10, 12, group, _h(**{n: i for i, n in enumerate(group)}))
    assert plan.is_complete and not plan.drops


def test_a_degraded_write_waits_for_a_node_then_fills_it():
    group11 = [f"n{i}" for i in range(11)]  # n11 down: only 11 usable
    holdings = _h(**{n: i for i, n in enumerate(group11)})
    plan = plan_repair(b"k", 10, 12, group11, holdings)
    assert plan.num_unplaced == 1 and not plan.rebuilds and not plan.is_complete
    plan = plan_repair(b"k", 10, 12, [*group11, "n11"], holdings)  # n11 is back
    assert plan.rebuilds == [(11, "n11")] and plan.leader == "n0" and plan.num_unplaced == 0


def test_lost_object_plans_nothing():
    plan = plan_repair(b"k", 10, 12, [f"n{i}" for i in range(12)], _h(n0=0, n1=1))
    assert plan.is_lost and not (plan.moves or plan.rebuilds or plan.drops)


def test_the_best_write_wins_and_other_writes_are_overwritten_or_dropped():
    group = ["A", "B", "C", "D"]
    holdings = {"A": Holding(0, 1), "B": Holding(1, 1), "C": Holding(2, 1), "D": Holding(3, 2), "X": Holding(0, 2)}
    plan = plan_repair(b"k", 2, 4, group, holdings)
    assert plan.write_id == 1 and plan.rebuilds == [(3, "D")] and plan.drops == ["X"]


def test_a_new_node_takes_one_fragment_from_the_node_pushed_out():
    group = ["A", "NEW", "B", "C"]  # NEW ranks second now; D held index 3 before it joined
    plan = plan_repair(b"k", 2, 4, group, _h(A=0, B=1, C=2, D=3))
    assert plan.moves == [(3, "D", "NEW")] and not plan.rebuilds and not plan.drops


def test_duplicate_index_keeps_the_group_copy():
    plan = plan_repair(b"k", 2, 4, ["A", "B", "C", "D"], _h(A=0, B=1, C=2, D=3, S=3))
    assert plan.is_complete and plan.drops == ["S"]
