"""The EPLB planner: from expert loads to a placement of replicas on GPUs.

Hierarchical, as DeepSeek's EPLB is: experts are first spread over nodes (a token's experts then
sit on few nodes and the weights of a re-placement move over NVLink only), then inside each node
the hottest experts are replicated and the replicas packed onto the node's GPUs. V4 routes
without expert groups, so nodes receive experts one by one.

Where it differs from DeepSeek's version (reimplemented as the baseline in tests/bench/eplb/):

* replica counts start from two rules, DeepSeek's (spares to the heaviest replica) and the
  widest spread (spares one per expert, heaviest first), and move one slot at a time while the
  packing stays more than COUNT_MOVE_GAP off the mean (``replicate.count_moves``);
* packing is LPT with replicas of an expert on different GPUs, then swaps (``packing``);
* given the window's per-step loads, swaps balance each step's slowest GPU, not only the mean,
  then a smoothed slowest GPU (``packing.step_cost``), which is also what the count rules and the
  kept layer are judged by;
* a layer keeps the placement in service unless the new one is better on the same statistics.
"""

from __future__ import annotations

import numpy as np

from deepinfer.engine.parallel.eplb.packing import STEP_TEMP, pack, step_cost
from deepinfer.engine.parallel.eplb.placement import gpu_loads, gpu_share
from deepinfer.engine.parallel.eplb.replicate import count_moves, replica_counts, spread_counts

MAX_HISTORY_STEPS = 128  # longer histories are summed into this many buckets of adjacent steps
COUNT_MOVES_TRIED = 16  # count moves re-balanced and compared per round
# count moves only while the heaviest GPU is this far above the mean: a move buys packability
# with a bigger replica, which the steps after the window pay for (on the bench's decode trace,
# moves that chased the last 0.05 % cost 0.3 points there)
COUNT_MOVE_GAP = 0.01


def plan(
    load: np.ndarray,
    num_physical_experts: int,
    num_gpus: int,
    num_nodes: int = 1,
    *,
    history: np.ndarray | None = None,
    current: np.ndarray | None = None,
) -> np.ndarray:
    """Place ``num_physical_experts`` replicas per layer on ``num_gpus`` GPUs.

    load: [layers, num_logical] tokens per logical expert (a window's total)
    num_physical_experts: slots per layer, a multiple of num_gpus, at least num_logical
    num_gpus: a multiple of num_nodes; num_logical a multiple of num_nodes
    history: [T, layers, num_logical] per-step tokens behind ``load`` (optional): packing then
        also balances each step's slowest GPU (steps beyond MAX_HISTORY_STEPS are bucketed)
    current: [layers, num_physical_experts] the placement in service: a layer keeps it unless
        the new one is better on the same statistics (moving weights for nothing costs bandwidth;
        and a heuristic can lose to a lucky placement on a small layer)
    Returns phy2log: [layers, num_physical_experts] int64; slot p is on GPU
        p // (num_physical_experts // num_gpus), and each GPU's slots are sorted by expert
    """
    load = np.asarray(load, dtype=np.float64)
    assert load.ndim == 2, f"load must be [layers, num_logical], got shape {load.shape}"
    num_layers, num_logical = load.shape
    assert (load >= 0).all(), "loads must be non-negative"
    assert num_gpus >= 1 and num_nodes >= 1 and num_gpus % num_nodes == 0, (
        f"{num_gpus} GPUs do not split over {num_nodes} nodes")
    assert num_logical % num_nodes == 0, f"{num_logical} experts do not split over {num_nodes} nodes"
    assert num_physical_experts % num_gpus == 0, f"{num_physical_experts} slots do not split over {num_gpus} GPUs"
    assert num_physical_experts >= num_logical, f"{num_physical_experts} slots cannot hold {num_logical} experts"
    slots_per_gpu = num_physical_experts // num_gpus
    gpus_per_node = num_gpus // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical_experts // num_nodes
    if history is not None:
        history = np.asarray(history, dtype=np.float64)
        assert history.ndim == 3 and history.shape[1:] == load.shape, (
            f"history must be [T, {num_layers}, {num_logical}], got {history.shape}")
        history = _bucket(history)

    if current is not None:
        current = np.asarray(current, dtype=np.int64)
        assert current.shape == (num_layers, num_physical_experts), (
            f"current must be [{num_layers}, {num_physical_experts}], got {current.shape}")
    phy2log = np.empty((num_layers, num_physical_experts), dtype=np.int64)
    for layer in range(num_layers):
        w = load[layer]
        h = None if history is None else history[:, layer]  # [T, num_logical]
        # Step 1: experts to nodes, an equal number each
        node_of = pack(w, num_nodes, experts_per_node, history=h)
        for node in range(num_nodes):
            experts = np.flatnonzero(node_of == node)  # [experts_per_node] node-local -> logical
            # Steps 2 and 3: replicas inside the node, packed onto its GPUs
            slot2local, gpu_of = _place_in_node(w[experts], None if h is None else h[:, experts],
                                                gpus_per_node, slots_per_gpu)
            for g in range(gpus_per_node):
                first = (node * gpus_per_node + g) * slots_per_gpu
                phy2log[layer, first : first + slots_per_gpu] = np.sort(experts[slot2local[gpu_of == g]])
        # Step 4: a layer keeps the placement in service unless the new one is better
        if current is not None:
            h = None if history is None else history[:, layer : layer + 1]
            new, old = (_layer_cost(load[layer : layer + 1], h, p[layer : layer + 1], num_gpus)
                        for p in (phy2log, current))
            if not new < old * (1 - 1e-9):
                phy2log[layer] = current[layer]
    return phy2log


def _layer_cost(load: np.ndarray, history: np.ndarray | None, phy2log: np.ndarray, num_gpus: int) -> float:
    """The planner's objective for one layer's placement. load: [1, E], history: [T, 1, E]."""
    share = gpu_share(phy2log, load.shape[1], num_gpus)
    if history is None or history.shape[0] == 0:
        return float(gpu_loads(load, share).max())
    return step_cost(gpu_loads(history, share)[:, 0], STEP_TEMP)


def _place_in_node(w: np.ndarray, h: np.ndarray | None, num_gpus: int, slots_per_gpu: int):
    """Steps 2 and 3 for one node of one layer. w: [E] tokens per expert, h: [T, E] per step or
    None. Returns (slot2expert [slots], gpu_of [slots]): each slot's expert (node-local), GPU."""
    num_slots = num_gpus * slots_per_gpu
    best = None
    # two starting counts: the heaviest-replica rule and the widest spread; the better is kept
    for start_counts in (replica_counts, spread_counts):
        # Step 2: replica counts, then pack the mean (Step 3) and move slots between experts
        # while the packing stays COUNT_MOVE_GAP off the mean
        counts = start_counts(w[None, :], num_slots)[0]
        slot2expert = np.repeat(np.arange(w.shape[0]), counts)
        gpu_of = pack(w[slot2expert] / counts[slot2expert], num_gpus, slots_per_gpu, kind=slot2expert)
        heaviest = _cost(w[slot2expert] / counts[slot2expert], None, gpu_of, num_gpus)
        for _ in range(num_slots):
            if heaviest <= w.sum() / num_gpus * (1 + COUNT_MOVE_GAP):
                break
            found = None  # the most promising moves, each re-balanced by swaps; the best is taken
            for slot, expert in count_moves(w, counts, slot2expert, gpu_of, num_gpus, COUNT_MOVES_TRIED):
                trial_counts, trial_slots = counts.copy(), slot2expert.copy()
                trial_counts[slot2expert[slot]] -= 1
                trial_counts[expert] += 1
                trial_slots[slot] = expert
                per = w[trial_slots] / trial_counts[trial_slots]
                trial_gpus = pack(per, num_gpus, slots_per_gpu, start=gpu_of)
                cost = _cost(per, None, trial_gpus, num_gpus)
                if cost < heaviest * (1 - 1e-9) and (found is None or cost < found[0]):
                    found = (cost, trial_counts, trial_slots, trial_gpus)
            if found is None:
                break
            heaviest, counts, slot2expert, gpu_of = found
        # Step 3 with the window's steps: swaps for each step's slowest GPU
        steps = None if h is None else h[:, slot2expert] / counts[slot2expert]  # [T, slots]
        if steps is not None:
            gpu_of = pack(w[slot2expert] / counts[slot2expert], num_gpus, slots_per_gpu, history=steps, start=gpu_of)
        cost = _cost(w[slot2expert] / counts[slot2expert], steps, gpu_of, num_gpus)
        if best is None or cost < best[2]:
            best = (slot2expert, gpu_of, cost)
    return best[0], best[1]


def _cost(per_replica: np.ndarray, steps: np.ndarray | None, gpu_of: np.ndarray, num_gpus: int) -> float:
    """What packing minimised: the heaviest GPU of the mean, or with steps the mean over steps of
    each step's heaviest GPU, smoothed (``step_cost``). per_replica: [R], steps: [T, R], gpu_of: [R]."""
    if steps is None or steps.shape[0] == 0:
        return float(np.bincount(gpu_of, weights=per_replica, minlength=num_gpus).max())
    per_gpu = np.zeros((steps.shape[0], num_gpus))
    np.add.at(per_gpu.T, gpu_of, steps.T)
    return step_cost(per_gpu, STEP_TEMP)


def _bucket(history: np.ndarray) -> np.ndarray:
    """[T, ...] -> [min(T, MAX_HISTORY_STEPS), ...]: adjacent steps summed into equal buckets."""
    num_steps = history.shape[0]
    if num_steps <= MAX_HISTORY_STEPS:
        return history
    edges = np.linspace(0, num_steps, MAX_HISTORY_STEPS + 1).astype(np.int64)
    return np.add.reduceat(history, edges[:-1], axis=0)
