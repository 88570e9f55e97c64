from __future__ import annotations

import itertools
import os
import random

import pytest
from pyeclib.ec_iface import ECDriver

from deepinfer.cache.store.ec import (
    ECConfig,
    ErasureCodec,
    ErasureCodingError,
    Fragment,
    NotEnoughFragments,
    payload_crc,
)


@pytest.fixture(scope="module")
def codec():
    return ErasureCodec(ECConfig())  # 10 + 2, isa_l_rs_vand


def test_default_is_10_plus_2_isa_l(codec):
    assert (codec.k, codec.m, codec.config.ec_type) == (10, 2, "isa_l_rs_vand")
    assert codec._data_offset == 80  # systematic layout found: all-data reads skip pyeclib
    frags = codec.encode(b"key", os.urandom(10_000))
    assert [f.header.index for f in frags] == list(range(12))
    assert all(f.header.key == b"key" and f.header.object_size == 10_000 for f in frags)
    assert all(f.is_intact() for f in frags)


@pytest.mark.parametrize("size", [1, 9, 10, 11, 4096, 100_003])
def test_decodes_from_any_k_fragments(codec, size):
    data = random.Random(size).randbytes(size)
    frags = codec.encode(b"k%d" % size, data)
    rng = random.Random(size)
    # every way of losing 2 of 12 for one size, random subsets of 10 for the rest
    subsets = itertools.combinations(range(12), 10) if size == 4096 else (rng.sample(range(12), 10) for _ in range(8))
    for subset in subsets:
        chosen = [frags[i] for i in subset]
        rng.shuffle(chosen)
        assert codec.decode(chosen) == data


def test_too_few_fragments_is_a_typed_error(codec):
    frags = codec.encode(b"k", os.urandom(5000))
    with pytest.raises(NotEnoughFragments, match="9 good distinct fragments, need 10"):
        codec.decode(frags[:9])
    # duplicates do not count twice
    with pytest.raises(NotEnoughFragments):
        codec.decode(frags[:9] + [frags[0]])


def test_damaged_fragment_is_skipped_not_decoded(codec):
    data = os.urandom(50_000)
    frags = codec.encode(b"k", data)
    bad = bytearray(frags[3].payload)
    bad[200] ^= 0xFF
    damaged = Fragment(frags[3].header, bytes(bad))
    assert not damaged.is_intact()
    # 11 given, one damaged: still 10 good ones
    assert codec.decode([damaged] + frags[:3] + frags[4:11]) == data
    with pytest.raises(NotEnoughFragments):
        codec.decode([damaged] + frags[:3] + frags[4:10])


def test_fragments_of_two_objects_never_mix(codec):
    a = codec.encode(b"a", os.urandom(20_000))
    b = codec.encode(b"b", os.urandom(20_000))
    with pytest.raises(ErasureCodingError, match="different objects"):
        codec.decode(a[:9] + b[9:10])


def test_configurable_small_code_and_plain_split():
    small = ErasureCodec(ECConfig(k=4, m=2))
    data = os.urandom(12345)
    frags = small.encode(b"x", data)
    assert len(frags) == 6
    assert small.decode(frags[2:]) == data
    with pytest.raises(ErasureCodingError, match="coded k=4 m=2"):
        ErasureCodec(ECConfig(k=10, m=2)).decode(frags)
    split = ErasureCodec(ECConfig(k=1, m=0))
    (whole,) = split.encode(b"x", data)
    assert whole.payload == data and split.decode([whole]) == data


def test_bad_config_and_empty_object_are_one_line_errors():
    with pytest.raises(ValueError, match="k >= 1"):
        ECConfig(k=0)
    with pytest.raises(ValueError, match="not available"):
        ErasureCodec(ECConfig(ec_type="no_such_backend"))
    with pytest.raises(ValueError, match="empty"):
        ErasureCodec().encode(b"k", b"")


def test_accepts_any_buffer_and_matches_raw_pyeclib(codec):
    import numpy as np
    import torch

    data = os.urandom(40_000)
    raw = ECDriver(k=10, m=2, ec_type="isa_l_rs_vand").encode(data)
    for buf in (data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        frags = codec.encode(b"k", buf)
        assert [f.payload for f in frags] == raw  # our path adds headers, never changes payloads
    tensor = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert codec.decode(codec.encode(b"t", tensor)) == data
    # memoryview payloads (as received off a socket) decode too
    frags = codec.encode(b"k", data)
    views = [Fragment(f.header, memoryview(f.payload)) for f in frags]
    assert codec.decode(views[1:11]) == data
    assert payload_crc(memoryview(frags[0].payload)) == frags[0].header.payload_crc
