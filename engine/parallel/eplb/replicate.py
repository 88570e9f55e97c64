"""How many replicas each logical expert gets."""

from __future__ import annotations

import numpy as np


def replica_counts(load: np.ndarray, num_physical: int) -> np.ndarray:
    """Give every expert one replica, then each spare slot to the expert whose replicas are the
    heaviest (``load / logcnt`` largest): this minimises the heaviest replica, the floor under
    the slowest GPU that no packing can go below (DeepSeek's rule).

    load: [layers, num_logical] tokens per expert; num_physical: slots per layer
    Returns logcnt: [layers, num_logical] int64, each row summing to num_physical
    """
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_logical = load.shape
    assert num_physical >= num_logical, f"{num_physical} slots cannot hold {num_logical} experts"
    counts = np.ones((num_layers, num_logical), dtype=np.int64)
    layers = np.arange(num_layers)
    for _ in range(num_physical - num_logical):
        hottest = np.argmax(load / counts, axis=1)  # ties: the lowest expert id
        counts[layers, hottest] += 1
    return counts


def spread_counts(load: np.ndarray, num_physical: int) -> np.ndarray:
    """Spares one per expert, heaviest expert first, round after round: the widest spread.
    load: [layers, num_logical] -> logcnt: [layers, num_logical]."""
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_logical = load.shape
    assert num_physical >= num_logical, f"{num_physical} slots cannot hold {num_logical} experts"
    rank = np.argsort(np.argsort(-load, axis=1, kind="stable"), axis=1)  # 0: heaviest
    return num_physical // num_logical + (rank < num_physical % num_logical).astype(np.int64)


def count_moves(load: np.ndarray, counts: np.ndarray, slot2expert: np.ndarray, gpu_of: np.ndarray,
                num_gpus: int, limit: int) -> list[tuple[int, int]]:
    """Candidate one-slot changes of replica counts, most promising first.

    The heaviest-replica rule ignores how replicas fall onto GPUs: one expert of 273 tokens and
    three of 2 on 2 GPUs of 3 slots gets counts [1, 3, 1, 1], and three replicas of 91 cannot be
    split evenly over two GPUs; [2, 2, 1, 1] halves both big experts. A move hands one slot on
    the heaviest GPU, held by an expert with two or more replicas, to another expert. Moves are
    ranked by the heaviest GPU right after the move, before any re-balancing (each replica
    carries load / count, so every GPU's new load follows from the counts).

    load: [E] tokens per expert; counts: [E]; slot2expert, gpu_of: [slots]
    Returns up to ``limit`` moves (slot, new expert)
    """
    load = np.asarray(load, dtype=np.float64)
    num_experts = load.shape[0]
    held = np.zeros((num_gpus, num_experts))  # [G, E] replicas of each expert on each GPU
    np.add.at(held, (gpu_of, slot2expert), 1.0)
    per = load / counts
    loads = held @ per  # [G]
    a = int(np.argmax(loads))
    on_a = np.zeros(num_gpus)
    on_a[a] = 1.0
    moves, peaks = [], []
    for f in np.flatnonzero((held[a] > 0) & (counts >= 2)):
        # f loses its replica on a and its other replicas grow; g gains one on a and all of
        # its replicas shrink -> [E, G] loads after moving to each g
        base = loads + (held[:, f] - on_a) * (load[f] / (counts[f] - 1)) - held[:, f] * per[f]  # [G]
        new = base[None, :] - held.T * per[:, None] + (held.T + on_a[None, :]) * (load / (counts + 1))[:, None]
        peak = new.max(axis=1)
        peak[f] = np.inf
        slot = int(np.flatnonzero((gpu_of == a) & (slot2expert == f))[0])
        moves += [(slot, int(g)) for g in range(num_experts) if g != f]
        peaks += [peak[g] for g in range(num_experts) if g != f]
    order = np.argsort(peaks, kind="stable")[:limit]
    return [moves[i] for i in order]
