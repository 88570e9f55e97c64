"""The audit leaves keys whose write is younger than ``audit_min_age_s`` for later: a write's
other fragments may still be in flight, and rebuilding one of them is wasted work."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deepinfer.cache.store.repair import RepairConfig, Repairer

pytestmark = pytest.mark.timeout(30)


class _Store:
    """What the audit asks of a FragmentStore: keys, holdings and write ages (a fake clock)."""

    def __init__(self, key2age: dict[bytes, float]):
        self.key2age = key2age

    def keys_lru_first(self):
        return list(self.key2age)

    def holding(self, key):
        return (0, 1, 0)  # index 0: this node audits the key

    def write_age_s(self, key):
        return self.key2age[key]


async def _run_io(fn, *args):
    return fn(*args)


def _repairer(store, tmp_path, min_age):
    rep = Repairer("n0", store, _run_io, tmp_path / "members.json", RepairConfig(audit_min_age_s=min_age))
    rep.peers = SimpleNamespace(config=SimpleNamespace(ec=SimpleNamespace(m=2)))
    rep._group = lambda key: ["n0"]
    return rep


async def test_young_keys_wait_until_their_write_is_old_enough(tmp_path):
    store = _Store({b"old": 10.0, b"young": 0.5})
    rep = _repairer(store, tmp_path, min_age=1.0)
    assert await rep._audit_keys(8) == [b"old"]
    assert set(rep._young) == {b"young"}
    assert rep.num_under_replicated == 0  # waiting to be judged is not under-replicated
    # due 0.5 s later: the next batch takes it without the audit
    rep._next_pass_at = float("inf")
    rep.peers.health = SimpleNamespace(unusable=lambda: set())
    store.take_lost = lambda: []
    batch, _ = await rep._next_batch()
    assert batch == []
    await asyncio.sleep(0.6)
    batch, urgent = await rep._next_batch()
    assert batch == [b"young"] and not urgent and not rep._young


async def test_zero_min_age_audits_everything_at_once(tmp_path):
    rep = _repairer(_Store({b"a": 0.0, b"b": 3.0}), tmp_path, min_age=0.0)
    assert await rep._audit_keys(8) == [b"a", b"b"]


async def test_keys_waiting_for_a_node_are_due_when_it_returns_even_while_another_is_out(tmp_path):
    """A key left short while a node was out waits the full back-off unless that node's return
    makes it due: also when another node drops out at the same moment (the flake of the metrics
    test: 0 repairs in 45 s after a restart)."""
    store = _Store({})
    store.take_lost = lambda: []
    rep = _repairer(store, tmp_path, min_age=0.0)
    rep._next_pass_at = float("inf")
    unusable = {"n11"}
    rep.peers.health = SimpleNamespace(unusable=lambda: set(unusable))
    rep._retry[b"short"] = (float("inf"), 30.0)  # waiting for a node to come back
    assert (await rep._next_batch())[0] == []
    unusable.clear()
    unusable.add("n05")  # n11 back, n05 out: not a subset of before
    assert (await rep._next_batch())[0] == [b"short"]
    rep._retry[b"short"] = (float("inf"), 30.0)
    assert (await rep._next_batch())[0] == []  # nothing came back since: it keeps waiting
