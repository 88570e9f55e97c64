"""Prefix-cache keys: a hash chain over full blocks of token ids.

    tokens:   [0, bs)        [bs, 2bs)        [2bs, 3bs)      ...   (only *full* blocks get a hash)
    hash:     h0 = H(root,   h1 = H(h0,       h2 = H(h1, ...)
                     t[0:bs],    t[bs:2bs],
                     extra0)     extra1)

``root`` salts the chain with the model id and a per-request cache salt, so two models (or two
tenants) never share blocks. ``extra`` carries the hashes of multimodal inputs whose placeholder
tokens overlap the block: an image changes the block's contents even though its placeholder token
ids are identical. Hashes are 16-byte blake2b digests: stable across processes and machines (the
store and cache-aware routers use them), unlike Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
HASH_BYTES = 16


@dataclass(frozen=True, slots=True)
class MultiModalSpan:
    """A multimodal input occupying prompt positions ``[offset, offset + length)``."""

    offset: int
    length: int
    content_hash: str

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


def root_hash(model_id: str, cache_salt: str = "") -> BlockHash:
    """The parent of block 0: separates models and cache-salt domains."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"deepinfer-root")
    h.update(model_id.encode())
    h.update(b"\x00")
    h.update(cache_salt.encode())
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"deepinfer-blk")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x01")
        h.update(key.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes`` (in place).

    Called at arrival for the prompt and again whenever generated tokens fill a block, so a
    preempted request's recompute (prompt + outputs) finds its own blocks.
    """
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        extra = [s.content_hash for s in mm_spans if s.overlaps(start, end)]
        parent = hash_block(parent, token_ids[start:end], extra)
        hashes.append(parent)
