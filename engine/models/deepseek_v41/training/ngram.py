"""The n-gram baseline: interpolated Kneser-Ney over token ids (numpy, sorted n-gram keys).

For order n the highest order uses raw counts, the lower ones continuation counts (how many
distinct tokens precede the n-gram); each level interpolates with the one below:

    P_n(w | h) = max(c(h, w) - D_n, 0) / c(h) + D_n * N1+(h .) / c(h) * P_{n-1}(w | h')
    P_0(w)     = 1 / V,      D_n = n1 / (n1 + 2 n2)   (n1, n2: n-grams seen once, twice)

and a context never seen (c(h) = 0) falls back to P_{n-1}. An n-gram is the int64 key
``((x_1 V + x_2) V + ...) V + x_n`` (V^order must fit in 63 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _keys(x: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """Keys of the n-grams ending at positions n-1 .. len(x)-1."""
    key = np.zeros(len(x) - n + 1, dtype=np.int64)
    for j in range(n):
        key = key * vocab + x[j : len(x) - n + 1 + j]
    return key


@dataclass
class _Level:
    keys: np.ndarray  # sorted distinct n-gram keys
    counts: np.ndarray  # their (raw or continuation) counts
    ctx: np.ndarray  # sorted distinct context keys
    ctx_total: np.ndarray  # sum of counts per context
    ctx_types: np.ndarray  # distinct followers per context
    discount: float


class KneserNey:
    def __init__(self, tokens: np.ndarray, vocab: int, order: int = 4):
        if vocab ** order >= 2**63:
            raise ValueError(f"vocab {vocab} ** order {order} overflows the int64 n-gram keys")
        x = np.asarray(tokens, dtype=np.int64)
        self.vocab, self.order = vocab, order
        self.levels: list[_Level] = []
        for n in range(1, order + 1):
            keys, counts = np.unique(_keys(x, n, vocab), return_counts=True)
            if n < order:  # continuation counts: distinct left extensions of each n-gram
                longer = np.unique(_keys(x, n + 1, vocab))
                keys, counts = np.unique(longer % vocab**n, return_counts=True)
            n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
            discount = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
            ctx_of = keys // vocab
            ctx, first = np.unique(ctx_of, return_index=True)
            total = np.add.reduceat(counts, first) if len(first) else counts[:0]
            types = np.diff(np.append(first, len(keys)))
            self.levels.append(_Level(keys, counts, ctx, total, types, discount))

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """Natural-log probability of ``tokens[i]`` given ``tokens[:i]``, for i = 1 .. len - 1."""
        x = np.asarray(tokens, dtype=np.int64)
        m = len(x) - 1
        p = np.full(m, 1.0 / self.vocab)
        for n, lv in enumerate(self.levels, start=1):
            keys = _keys(x, n, self.vocab) if len(x) >= n else x[:0]  # n-grams ending at n-1 .. len-1
            if n == 1:
                keys = keys[1:]  # targets start at index 1
            if not len(keys):
                break
            count = _lookup(lv.keys, lv.counts, keys)
            ctx_total = _lookup(lv.ctx, lv.ctx_total, keys // self.vocab)
            ctx_types = _lookup(lv.ctx, lv.ctx_types, keys // self.vocab)
            lower = p[m - len(keys) :]
            seen = ctx_total > 0
            safe = np.maximum(ctx_total, 1)
            mixed = np.maximum(count - lv.discount, 0) / safe + lv.discount * ctx_types / safe * lower
            p[m - len(keys) :] = np.where(seen, mixed, lower)
        return np.log(p)


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``values`` at ``query`` in the sorted ``keys`` (0 where absent)."""
    if not len(keys):
        return np.zeros(len(query), dtype=np.int64)
    i = np.searchsorted(keys, query).clip(0, len(keys) - 1)
    return np.where(keys[i] == query, values[i], 0)
