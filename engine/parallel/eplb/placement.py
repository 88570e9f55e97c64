"""Placements of physical expert slots and the load model both planners are judged by.

One layer's placement is ``phy2log[num_physical_experts]``: slot p holds a replica of logical
expert ``phy2log[p]`` and lives on GPU ``p // slots_per_gpu``:

    slots:  | GPU 0: 0 .. S-1 | GPU 1: S .. 2S-1 | ... | GPU G-1: (G-1)S .. GS-1 |

Load model: a logical expert's tokens split evenly over its replicas, so each replica of expert
e carries ``load[e] / logcnt[e]`` and a GPU carries the sum over its slots. (A dispatcher that
split tokens unevenly could do better on a bad placement; we plan and measure with the even
split, the rule a stateless dispatcher applies.) A step waits for its slowest GPU at every MoE
layer, so the realised imbalance of a step is ``sum_layers max_gpu / sum_layers mean_gpu``: the
MoE time taken over the time a perfect balance would take.
"""

from __future__ import annotations

import numpy as np


def logcnt(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Replicas per logical expert. phy2log: [layers, num_physical] -> [layers, num_logical]."""
    phy2log = np.asarray(phy2log)
    counts = np.zeros((phy2log.shape[0], num_logical), dtype=np.int64)
    np.add.at(counts, (np.arange(phy2log.shape[0])[:, None], phy2log), 1)
    return counts


def log2phy(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Slots of each logical expert, ascending, padded with -1.

    phy2log: [layers, num_physical] -> [layers, num_logical, max replicas]
    """
    phy2log = np.asarray(phy2log)
    num_layers, num_physical = phy2log.shape
    counts = logcnt(phy2log, num_logical)
    out = np.full((num_layers, num_logical, max(1, int(counts.max()))), -1, dtype=np.int64)
    # a stable sort groups each layer's slots by expert, in slot order; rank = position in group
    order = np.argsort(phy2log, axis=1, kind="stable")
    experts = np.take_along_axis(phy2log, order, axis=1)
    first = np.cumsum(counts, axis=1) - counts
    rank = np.arange(num_physical)[None, :] - np.take_along_axis(first, experts, axis=1)
    out[np.arange(num_layers)[:, None], experts, rank] = order
    return out


def gpu_share(phy2log: np.ndarray, num_logical: int, num_gpus: int) -> np.ndarray:
    """Fraction of each logical expert's tokens that each GPU computes under the even split.

    phy2log: [layers, num_physical] -> [layers, num_logical, num_gpus] (rows sum to 1)
    """
    phy2log = np.asarray(phy2log)
    num_layers, num_physical = phy2log.shape
    assert num_physical % num_gpus == 0, f"{num_physical} slots do not split over {num_gpus} GPUs"
    counts = logcnt(phy2log, num_logical)
    assert (counts > 0).all(), "every logical expert needs a replica"
    gpu_of_slot = np.arange(num_physical) // (num_physical // num_gpus)
    share = np.zeros((num_layers, num_logical, num_gpus))
    layer = np.arange(num_layers)[:, None]
    np.add.at(share, (layer, phy2log, gpu_of_slot[None, :]), 1.0 / counts[layer, phy2log])
    return share


def gpu_loads(load: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Tokens per GPU. load: [..., layers, num_logical], share: [layers, num_logical, num_gpus]
    -> [..., layers, num_gpus]."""
    return np.einsum("...le,leg->...lg", np.asarray(load, dtype=np.float64), share)


def imbalance(gpu_load: np.ndarray) -> float:
    """Slowest GPU over the mean, summed over every leading axis (layers, steps) as a step's MoE
    time is. gpu_load: [..., num_gpus]."""
    gpu_load = np.asarray(gpu_load, dtype=np.float64)
    mean = gpu_load.mean(axis=-1).sum()
    return float(gpu_load.max(axis=-1).sum() / mean) if mean > 0 else 1.0


def static_placement(num_layers: int, num_logical: int, num_physical: int, num_gpus: int) -> np.ndarray:
    """The placement before any statistics: slot p holds expert p mod num_logical, so each GPU
    owns a contiguous run of experts and the last slots repeat the first experts.
    -> phy2log [layers, num_physical]."""
    assert num_physical >= num_logical and num_physical % num_gpus == 0
    return np.tile(np.arange(num_physical, dtype=np.int64) % num_logical, (num_layers, 1))


def check_placement(phy2log: np.ndarray, num_logical: int, num_gpus: int) -> None:
    """Assert the invariants of a placement: shape, ids in range, every expert replicated."""
    phy2log = np.asarray(phy2log)
    assert phy2log.ndim == 2, f"phy2log must be [layers, num_physical], got shape {phy2log.shape}"
    assert phy2log.shape[1] % num_gpus == 0, f"{phy2log.shape[1]} slots do not split over {num_gpus} GPUs"
    assert phy2log.min() >= 0 and phy2log.max() < num_logical, "phy2log names an expert out of range"
    missing = np.argwhere(logcnt(phy2log, num_logical) == 0)
    assert len(missing) == 0, f"layer {missing[0][0]}: expert {missing[0][1]} has no replica" if len(missing) else ""
