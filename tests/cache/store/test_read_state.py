from __future__ import annotations

import os

from deepinfer.cache.store.ec import ECConfig, ErasureCodec
from deepinfer.cache.store.read_state import KeyRead

NODES = [f"n{i}" for i in range(12)]


def _frags(key=b"key", seed=0):
    return ErasureCodec(ECConfig(k=10, m=2)).encode(key, os.urandom(3000))


def test_first_k_answers_win_without_waiting_for_the_slowest():
    frags = _frags()
    read = KeyRead(b"key", 10, NODES, first_wave_size=11)
    assert read.start() == NODES[:11]
    for i in range(10):
        assert not read.is_ready
        read.on_fragment(NODES[i], frags[i], write_id=1)
    assert read.is_ready and read.hedge() == []  # the 11th node is never waited on
    assert [f.header.index for f in read.fragments()] == list(range(10))


def test_two_failures_in_the_first_wave_hedge_at_once():
    frags = _frags()
    read = KeyRead(b"key", 10, NODES, first_wave_size=11)
    read.start()
    read.on_absent("n0")
    assert not read.must_hedge_now  # 10 pending can still make it
    read.on_absent("n1")
    assert read.must_hedge_now
    assert read.hedge() == ["n11"]
    for i in range(2, 12):
        read.on_fragment(NODES[i], frags[i], write_id=1)
    assert read.is_ready and not read.is_hopeless


def test_hopeless_once_every_node_answered_short():
    read = KeyRead(b"key", 10, NODES, first_wave_size=11)
    read.start()
    for n in NODES[:3]:
        read.on_absent(n)
    read.hedge()
    assert read.is_hopeless  # 9 pending at most, need 10


def test_two_writes_never_mix_and_foreign_fragments_are_ignored():
    a, b = _frags(), _frags()  # same key, different bytes (two writes)
    read = KeyRead(b"key", 10, NODES, first_wave_size=12)
    read.start()
    for i in range(5):
        read.on_fragment(NODES[i], a[i], write_id=1)
    for i in range(5, 10):
        read.on_fragment(NODES[i], b[i], write_id=2)
    read.on_fragment(NODES[10], _frags(b"other")[10], write_id=1)
    assert not read.is_ready and read.num_best == 5 and read.num_bad == 1
    read.on_fragment(NODES[11], b[11], write_id=2)
    assert read.num_best == 6


def test_short_because_of_unreachable_nodes_is_unavailable_not_a_miss():
    frags = _frags()
    # 3 of the key's 12 nodes skipped (down), 9 answer with their fragment: k=10 not reachable
    read = KeyRead(b"key", 10, NODES[3:], first_wave_size=9, skipped=NODES[:3])
    read.start()
    for i in range(3, 12):
        read.on_fragment(NODES[i], frags[i], write_id=1)
    read.hedge()
    assert read.is_hopeless and read.is_unavailable and read.unavailable_nodes() == NODES[:3]
    # a key nobody stored: even the skipped nodes could not make up k, so it is a plain miss
    read = KeyRead(b"key", 10, NODES[1:], first_wave_size=11, skipped=NODES[:1])
    read.start()
    for node in NODES[1:]:
        read.on_absent(node)
    read.hedge()
    assert read.is_hopeless and not read.is_unavailable
    # asked nodes that failed (connection lost) count like skipped ones
    read = KeyRead(b"key", 10, NODES, first_wave_size=12)
    read.start()
    for i in range(9):
        read.on_fragment(NODES[i], frags[i], write_id=1)
    for node in NODES[9:]:
        read.on_failed(node)
    read.hedge()
    assert read.is_hopeless and read.is_unavailable and read.unavailable_nodes() == NODES[9:]


def test_a_key_no_usable_node_holds_is_a_miss_even_when_its_first_answer_comes_before_the_rest():
    """4 of 6 nodes usable (2 down), k=4: a key whose write never reached quorum is absent on all
    4. The first "not here" already makes k unreachable; the verdict waits until the answers
    make it a MISS (UNAVAILABLE made engines skip the store for seconds)."""
    nodes = [f"n{i}" for i in range(6)]
    read = KeyRead(b"key", 4, nodes[2:], first_wave_size=5, skipped=nodes[:2])
    read.start()
    read.on_absent("n2")
    assert read.must_hedge_now and read.hedge() == []
    assert not read.is_hopeless  # n3..n5 may still say "not here"
    read.on_absent("n3")
    assert not read.is_hopeless  # n4 + n5 + the 2 down nodes could still hold k fragments
    read.on_absent("n4")
    assert read.is_hopeless and not read.is_unavailable  # at most n5 + 2 down nodes: a miss, n5 or not
    # the same start, but the others fail too: nothing heard, the down nodes might hold it
    read = KeyRead(b"key", 4, nodes[2:], first_wave_size=5, skipped=nodes[:2])
    read.start()
    read.on_absent("n2")
    read.hedge()
    read.on_failed("n3")
    read.on_failed("n4")
    assert read.is_hopeless and read.is_unavailable  # 2 skipped + 2 failed could make up k: no wait for n5
