"""DeepSeek's EPLB (github.com/deepseek-ai/EPLB), reimplemented from its description as the
baseline ``deepinfer bench eplb`` measures our planner against. Not product code.

Its algorithm, in three steps per layer:

1. Balanced packing of expert groups onto nodes: groups sorted by load, heaviest first, each into
   the lightest node that still has room for a group (equal group counts per node).
2. Inside each node, replicate: every spare slot goes to the expert whose replicas are heaviest
   (load / replica count largest).
3. Balanced packing of the node's replicas (each weighing load / replica count) onto its GPUs,
   the same greedy as step 1 with slots per GPU as the room.

When the groups do not split over the nodes it runs the same steps with one group and one node
(its "global" policy, used for decode). There is no refinement after the greedy and nothing
keeps two replicas of an expert off one GPU; the per-step history is ignored.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """weight: [n] with n a multiple of num_packs -> pack_of: [n], n / num_packs items per pack."""
    n = weight.shape[0]
    assert n % num_packs == 0
    room = n // num_packs
    loads = np.zeros(num_packs)
    sizes = np.zeros(num_packs, dtype=np.int64)
    pack_of = np.empty(n, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        open_packs = np.flatnonzero(sizes < room)
        p = open_packs[np.argmin(loads[open_packs])]
        pack_of[item] = p
        loads[p] += weight[item]
        sizes[p] += 1
    return pack_of


def replicate(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """weight: [n] -> logcnt: [n], each spare slot to the expert with the heaviest replicas."""
    counts = np.ones(weight.shape[0], dtype=np.int64)
    for _ in range(num_slots - weight.shape[0]):
        counts[np.argmax(weight / counts)] += 1
    return counts


def deepseek_plan(load: np.ndarray, num_physical_experts: int, num_gpus: int, num_nodes: int = 1, *,
                  num_groups: int | None = None, history=None, current=None) -> np.ndarray:
    """The baseline with our planner's signature. load: [layers, num_logical] ->
    phy2log: [layers, num_physical_experts], GPU g holding slots [g*S, (g+1)*S)."""
    del history, current  # DeepSeek's EPLB plans from the window's total only, and always re-places
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_logical = load.shape
    num_groups = num_logical if num_groups is None else num_groups
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # its global policy
    assert num_logical % num_groups == 0 and num_gpus % num_nodes == 0 and num_physical_experts % num_gpus == 0
    group_size = num_logical // num_groups
    slots_per_gpu = num_physical_experts // num_gpus
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = num_physical_experts // num_nodes
    phy2log = np.empty((num_layers, num_physical_experts), dtype=np.int64)
    for layer in range(num_layers):
        w = load[layer]
        # Step 1: groups to nodes
        node_of_group = balanced_packing(w.reshape(num_groups, group_size).sum(axis=1), num_nodes)
        for node in range(num_nodes):
            groups = np.flatnonzero(node_of_group == node)
            experts = (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
            # Step 2: replicate inside the node
            counts = replicate(w[experts], slots_per_node)
            replica2local = np.repeat(np.arange(experts.shape[0]), counts)
            # Step 3: replicas onto the node's GPUs
            gpu_of = balanced_packing((w[experts] / counts)[replica2local], gpus_per_node)
            for g in range(gpus_per_node):
                first = (node * gpus_per_node + g) * slots_per_gpu
                phy2log[layer, first : first + slots_per_gpu] = experts[replica2local[gpu_of == g]]
    return phy2log
