from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.cache.host_tier import HostTier


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lru_eviction_by_bytes_with_stats():
    tier = HostTier(capacity_bytes=1000)
    for i in range(4):
        assert tier.put(h(i), bytes(250)) == []
    assert tier.used_bytes == 1000 and len(tier) == 4
    assert tier.get(h(0)) is not None  # 0 becomes most recent; 1 is now the oldest
    evicted = tier.put(h(9), bytes(400))
    assert evicted == [h(1), h(2)]
    assert tier.get(h(1)) is None
    s = tier.stats()
    assert (s.num_hits, s.num_misses, s.num_evictions, s.num_blocks, s.used_bytes) == (1, 1, 2, 3, 900)
    assert s.hit_rate == 0.5
    tier.check_integrity()


def test_sizes_of_arrays_tensors_and_replacement():
    tier = HostTier(capacity_bytes=10_000)
    tier.put(h(1), np.zeros((10, 10), dtype=np.float32))
    tier.put(h(2), torch.zeros(100, dtype=torch.bfloat16))
    assert tier.used_bytes == 400 + 200
    tier.put(h(1), bytes(1000))  # replacing a block re-accounts it
    assert tier.used_bytes == 1200 and len(tier) == 2
    assert tier.pop(h(2)) is not None and tier.used_bytes == 1000
    assert tier.stats().num_evictions == 0
    tier.check_integrity()


def test_oversized_block_is_rejected_not_stored():
    tier = HostTier(capacity_bytes=100)
    tier.put(h(1), bytes(50))
    assert tier.put(h(2), bytes(101)) == []
    assert h(2) not in tier and h(1) in tier
    assert tier.stats().num_rejected == 1


def test_prefix_hits_do_not_touch_recency():
    tier = HostTier(capacity_bytes=300)
    for i in range(3):
        tier.put(h(i), bytes(100))
    assert tier.num_prefix_hits([h(0), h(1), h(7), h(2)]) == 2
    assert tier.num_prefix_hits([]) == 0
    assert tier.put(h(5), bytes(100)) == [h(0)]  # 0 is still the LRU
    assert tier.stats().num_hits == 0
    with pytest.raises(ValueError, match="capacity"):
        HostTier(-1)
