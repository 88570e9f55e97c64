"""Paged block cache: geometry checks and whole-block moves."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cache.block_cache import BlockCache, BlockCacheError, PagedSpec

SPECS = [PagedSpec(1, "compressed", 4, 8), PagedSpec(1, "indexer_keys", 4, 3), PagedSpec(2, "compressed", 16, 8)]


def make(num_blocks=5):
    return BlockCache(SPECS, num_blocks=num_blocks, block_size=16, dtype=torch.float32, device="cpu")


def test_shapes_follow_ratio_and_rows_are_flat_addressable():
    cache = make()
    assert cache.tensor(1, "compressed").shape == (5, 4, 8)
    assert cache.tensor(2, "compressed").shape == (5, 1, 8)
    assert cache.bytes_per_block == (4 * 8 + 4 * 3 + 1 * 8) * 4
    flat = cache.flat(1, "compressed")
    flat[2 * 4 + 3] = 7.0  # block 2, row 3
    assert torch.all(cache.tensor(1, "compressed")[2, 3] == 7.0)
    assert torch.all(cache.tensor(1, "compressed")[2, :3] == 0)  # zero-filled at start


def test_the_dump_block_is_flat_addressable_and_outside_every_block_api():
    """Padding writes of a graphed forward go to the dump block (id num_blocks): flat rows reach it,
    the block views and block moves do not."""
    cache = make()
    assert cache.dump_block == 5 and cache.dump_row(4) == 5 * 4 and cache.dump_row(16) == 5
    for spec in SPECS:
        flat = cache.flat(spec.layer, spec.name)
        assert flat.shape[0] == 6 * (16 // spec.ratio)
        flat[cache.dump_row(spec.ratio):] = 9.0
        assert not cache.tensor(spec.layer, spec.name).any()  # the dump block is not one of the blocks
    assert all(not t.any() for t in cache.read_blocks(range(5)).values())
    with pytest.raises(BlockCacheError, match="out of range"):
        cache.read_blocks([cache.dump_block])
    with pytest.raises(BlockCacheError, match="out of range"):
        cache.copy_blocks([0], [cache.dump_block])


def test_block_size_must_be_a_multiple_of_every_ratio():
    with pytest.raises(BlockCacheError, match="multiple of every compress ratio"):
        BlockCache([PagedSpec(0, "compressed", 12, 4)], num_blocks=2, block_size=16, dtype=torch.float32, device="cpu")
    with pytest.raises(BlockCacheError, match="num_blocks"):
        BlockCache(SPECS, num_blocks=0, block_size=16, dtype=torch.float32, device="cpu")


def test_copy_read_write_blocks():
    cache = make()
    for spec in SPECS:
        cache.tensor(spec.layer, spec.name).normal_()
    before = cache.read_block(1)
    cache.copy_blocks([1, 3], [4, 0])
    assert all(torch.equal(before[k], v) for k, v in cache.read_block(4).items())
    cache.write_block(2, before)
    assert all(torch.equal(before[k], v) for k, v in cache.read_block(2).items())
    with pytest.raises(BlockCacheError, match="out of range"):
        cache.copy_blocks([9], [0])
    with pytest.raises(BlockCacheError, match="missing tensors"):
        cache.write_block(0, {"1.compressed": before["1.compressed"]})
