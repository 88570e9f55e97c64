"""Counter-based random numbers for sampling: noise = hash(seed, position, token id).

No generator state exists: the Gumbel noise a request sees for token ``v`` at absolute position
``t`` is a pure function of (seed, t, v). A request's samples therefore never depend on which
other requests share its batch, on the row it landed in, on preemption and recompute, or on how
many steps it took to get there. The mixer is a 32-bit integer finaliser (xorshift-multiply
rounds) evaluated in int64 tensors; every multiplier is < 2^31 so products of 32-bit values stay
below 2^63 and int64 arithmetic never overflows, on any device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

M32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x2C1B3C6D
# the largest float32 below 1: uniforms are clamped to it, since (2^24 - 1 + 0.5) * 2^-24 rounds
# to 1.0 and -log(-log(1)) is +inf (noise that beats a grammar's -inf mask: NaN, a masked token)
U_MAX = 1.0 - 2.0**-24
_TOKEN_SALT = 0x9E3779B9
_KEY_SALT = 0x85EBCA6B


def mix32(x: int) -> int:
    """Scalar twin of ``mix32_tensor`` (per-row keys are mixed in Python: B values per step)."""
    x &= M32
    x ^= x >> 16
    x = (x * MUL_A) & M32
    x ^= x >> 15
    x = (x * MUL_B) & M32
    x ^= x >> 16
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """Same as ``mix32`` on an int64 tensor whose values are in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & M32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & M32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4096)
def seed_key(seed: int) -> int:
    """32-bit key of a 64-bit seed (cached: a request samples many positions with one seed)."""
    seed &= (1 << 64) - 1
    return mix32(mix32((seed & M32) ^ _KEY_SALT) ^ (seed >> 32))


def row_key(seed: int, position: int) -> int:
    """A 32-bit key for one (seed, position): all 64 bits of the seed and of the position enter."""
    k = mix32(seed_key(seed) ^ (position & M32))
    return mix32(k ^ (position >> 32) ^ _KEY_SALT) if position > M32 else k


def mix32_np(x: np.ndarray) -> np.ndarray:
    """``mix32`` on a uint32 array: uint32 arithmetic wraps mod 2^32, so no masking is needed
    (about 3x fewer passes than the int64 tensor form on CPU); same values bit for bit."""
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(MUL_A)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MUL_B)
    x ^= x >> np.uint32(16)
    return x


def row_keys(seed_keys: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Vectorised ``row_key`` from per-row ``seed_key(seed)`` values: int64 array of keys."""
    pos = np.asarray(positions, dtype=np.int64)
    keys = mix32_np(np.asarray(seed_keys, dtype=np.uint32) ^ (pos & M32).astype(np.uint32))
    high = pos > M32
    if high.any():
        hi = (pos[high] >> 32).astype(np.uint32)
        keys[high] = mix32_np(keys[high] ^ hi ^ np.uint32(_KEY_SALT))
    return keys.astype(np.int64)


# rows per block of ``GumbelNoise._gumbel_cpu``: two uint32 blocks of this many elements fit in L2
_NOISE_BLOCK_ELEMENTS = 1 << 16


class GumbelNoise:
    """Gumbel(0, 1) noise for rows of logits: ``u = mix32(key[row] ^ token_hash[v])``.

    ``token_hash`` is a bijection of the token id (precomputed once), so within a row every
    token's input to the mixer is distinct; one mixing round per element keeps this at ~16
    elementwise passes over ``[B, V]``."""

    def __init__(self) -> None:
        self._token_hash: torch.Tensor | None = None
        self._token_hash32: torch.Tensor | None = None

    def token_hash(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        th = self._token_hash
        if th is None or th.numel() != vocab_size or th.device != device:
            ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
            th = mix32_tensor((ids + _TOKEN_SALT) & M32)
            self._token_hash = th
        return th

    def token_hash32(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """``token_hash`` as int32 bit patterns (values >= 2^31 wrap), for fused GPU kernels."""
        th = self._token_hash32
        if th is None or th.numel() != vocab_size or th.device != device:
            h = self.token_hash(vocab_size, device)
            th = self._token_hash32 = torch.where(h >= 1 << 31, h - (1 << 32), h).to(torch.int32)
        return th

    def uniform(self, keys: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
        """U(0,1) float32 ``[B, V]`` (or ``[B, K]`` at ``token_ids [B, K]``); keys ``[B]`` int64."""
        th = self.token_hash(vocab_size, keys.device)
        th = th[token_ids] if token_ids is not None else th.unsqueeze(0)
        if keys.device.type == "cpu":
            # uint32 numpy: the same integers in a third of the passes (and no GIL hand-offs
            # between many small torch calls when this runs on the engine's device thread)
            x = mix32_np(keys.numpy().astype(np.uint32)[:, None] ^ th.numpy().astype(np.uint32))
            h = torch.from_numpy((x >> np.uint32(8)).astype(np.int64))
            return ((h.to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=U_MAX)
        h = mix32_tensor(keys.unsqueeze(1) ^ th)
        # 24 bits, +0.5: inside (0, 1) except the top value, whose 1 - 2^-25 rounds to 1.0 in float32
        return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=U_MAX)

    def gumbel(self, keys: torch.Tensor, vocab_size: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Gumbel(0, 1) = -log(-log(u)), float32 ``[B, V]`` (or ``[B, K]`` at ``token_ids``)."""
        if keys.device.type == "cpu" and token_ids is None:
            return self._gumbel_cpu(keys, vocab_size)
        u = self.uniform(keys, token_ids, vocab_size)
        return -torch.log(-torch.log(u))

    def _gumbel_cpu(self, keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``gumbel`` over the whole vocabulary on CPU, bit for bit: the same integer hash,
        float conversion and torch.log, done in place on blocks of rows that stay in the L2
        cache (the one-shot form makes a dozen [B, V] temporaries; at 256 x 4096 that is half
        of its ~16 ms)."""
        th = self.token_hash(vocab_size, keys.device).numpy().astype(np.uint32)
        k = keys.numpy().astype(np.uint32)
        out = torch.empty(k.shape[0], vocab_size, dtype=torch.float32)
        out_np = out.numpy()
        rows = max(1, _NOISE_BLOCK_ELEMENTS // max(vocab_size, 1))
        x = np.empty((min(rows, k.shape[0]), vocab_size), dtype=np.uint32)
        t = np.empty_like(x)
        for r0 in range(0, k.shape[0], rows):
            r1 = min(r0 + rows, k.shape[0])
            xb, tb = x[: r1 - r0], t[: r1 - r0]
            np.bitwise_xor(k[r0:r1, None], th, out=xb)
            for shift, mul in ((16, MUL_A), (15, MUL_B)):  # mix32_np, in place
                np.right_shift(xb, np.uint32(shift), out=tb)
                xb ^= tb
                xb *= np.uint32(mul)
            np.right_shift(xb, np.uint32(16), out=tb)
            xb ^= tb
            xb >>= np.uint32(8)  # 24 bits: exact in float32
            ub = out_np[r0:r1]
            ub[...] = xb
            ub += np.float32(0.5)  # the same float32 rounding as the torch form
            ub *= np.float32(1.0 / (1 << 24))
            np.minimum(ub, np.float32(U_MAX), out=ub)
            g = out[r0:r1]
            torch.log(g, out=g).neg_()  # torch's log, as everywhere else: same bits
            torch.log(g, out=g).neg_()
        return out
