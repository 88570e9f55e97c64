"""Pack weighted items into packs of exactly ``items_per_pack`` each (replicas onto GPUs, experts
onto nodes), as evenly as possible.

Three steps, each starting from the last:

1. LPT: heaviest item first, into the lightest pack with room that holds no item of the same
   kind yet: replicas of one expert on different GPUs share out that expert's busy steps, where
   two on one GPU rise and fall together (on the bench's tiny-model traces this start keeps a
   mean-balanced plan 2-4 points better on the steps after the window).
2. Swap refinement on the mean: while some swap of an item of the heaviest pack with a lighter
   item elsewhere lowers the heavier of the two packs, make the best such swap (kinds no longer
   matter: a swap that pairs two replicas is taken when it balances better). LPT alone leaves
   the heaviest pack a few items' difference above the mean when packs hold few items (decode:
   5 slots per GPU); the swaps close most of that gap.
3. Swap refinement on the steps (when a per-step ``history`` is given): a step waits for its own
   slowest pack, and items that are busy in the same steps (experts of one topic, hot in the same
   requests) make one pack the slowest again and again while the mean looks balanced. Swaps now
   minimise the mean over the history's steps of the heaviest pack, which is the figure a step
   time follows.
4. Swap refinement on the smoothed steps (``STEP_TEMP`` > 0, at most ``MAX_SMOOTHED_PACKS``
   packs): the same swaps, scored by a
   log-sum-exp of each step's pack loads instead of its max (``step_cost``). A pack just below
   the slowest one in a window step counts almost as much as the slowest: after the window,
   fresh noise decides which of the two is slower. Step 3's exact max fits the window's own
   noise (the hard fit ends far below what the next steps realise); the smoothed one carries over.
"""

from __future__ import annotations

import numpy as np

TOLERANCE = 1e-9  # relative: a swap must improve its objective by more than this to be taken
# step refinement: items of the slowest pack considered for a swap. A wider search fits the window
# better and the fit carries over: on the bench's synthetic prefill EP4 traces (seeds 0/1/2) 16 -> 32
# gave 1.052/1.054/1.057 -> 1.050/1.053/1.052; CV over the window's halves and low-rank
# denoising of the steps were worse (README, "Expert parallelism and EPLB")
MAX_SWAP_OUT = 32
# step 4's temperature, relative to each step's mean pack load: a plan's GPU loads on the steps after
# its window differ from the window's by fresh per-request noise of about 3 % of the mean (the
# window fits to 1.020, the next 1000 steps realise 1.051 on the bench's prefill EP4 traces), so a
# GPU a few points below the slowest in a window step is as likely to be the slowest later. The
# log-sum-exp at 0.04 scores the window as the steps after it will go. The bench's synthetic prefill
# EP4 replay (seeds 0 / 1 / 2): 1.0497 / 1.0530 / 1.0523 without step 4; with it (count rules and
# the kept layer still judged by the exact max) 0.02: 1.0488 / 1.0507 / 1.0528, 0.03: 1.0484 /
# 1.0505 / 1.0507, 0.04: 1.0487 / 1.0505 / 1.0519, 0.05: 1.0485 / 1.0502 / 1.0514. The planner
# judges by this cost too (planner._cost, _layer_cost); with prefill's drift margin on top see
# schedule.PREFILL_DRIFT_MARGIN.
STEP_TEMP = 0.04
# step 4 runs for prefill's EP sizes: decode's EP64 steps average thousands of sequences, and its
# many small swaps there took a 4-layer plan from 4.8 s to 10.6 s on this 2-core machine
MAX_SMOOTHED_PACKS = 8


def pack(
    weight: np.ndarray,
    num_packs: int,
    items_per_pack: int,
    *,
    kind: np.ndarray | None = None,
    history: np.ndarray | None = None,
    start: np.ndarray | None = None,
    max_swaps: int | None = None,
) -> np.ndarray:
    """Assign ``n = num_packs * items_per_pack`` items to packs, exactly items_per_pack each.

    weight: [n] load of each item (the mean the packing balances)
    kind: [n] int, LPT puts items of one kind in different packs while it can (default: all
        kinds distinct)
    history: [T, n] per-step load of each item; step 3 runs when given
    start: [n] an assignment with items_per_pack per pack to refine instead of LPT's
    max_swaps: cap on swaps per refinement step (default: n)
    Returns pack_of: [n] int64, the pack of each item
    """
    weight = np.asarray(weight, dtype=np.float64)
    n = weight.shape[0]
    assert weight.ndim == 1 and n == num_packs * items_per_pack, (
        f"{n} items do not fill {num_packs} packs of {items_per_pack}")
    assert (weight >= 0).all(), "item weights must be non-negative"
    kind = np.arange(n) if kind is None else np.asarray(kind, dtype=np.int64)
    assert kind.shape == (n,)
    if num_packs == 1:
        return np.zeros(n, dtype=np.int64)
    max_swaps = n if max_swaps is None else max_swaps
    _, kind = np.unique(kind, return_inverse=True)  # dense kind ids for LPT's table

    # Step 1: LPT
    if start is None:
        state = _PackState.lpt(weight, kind, num_packs, items_per_pack)
    else:
        start = np.array(start, dtype=np.int64)
        assert start.shape == (n,) and (np.bincount(start, minlength=num_packs) == items_per_pack).all(), (
            f"start must put {items_per_pack} items in each of {num_packs} packs")
        state = _PackState(weight, start, num_packs)
    # Step 2: swaps that lower the heaviest pack's mean load
    state.refine_mean(max_swaps)
    # Step 3: swaps that lower the mean over steps of the slowest pack
    if history is not None:
        history = np.asarray(history, dtype=np.float64)
        assert history.ndim == 2 and history.shape[1] == n, f"history must be [T, {n}], got {history.shape}"
        if history.shape[0] > 0:
            state.refine_steps(history, max_swaps)
            if STEP_TEMP > 0 and num_packs <= MAX_SMOOTHED_PACKS:  # Step 4
                state.refine_soft(history, max_swaps, STEP_TEMP)
    return state.pack_of


class _PackState:
    """An assignment with its pack loads, updated swap by swap."""

    def __init__(self, weight, pack_of, num_packs):
        self.weight, self.pack_of = weight, pack_of
        self.loads = np.bincount(pack_of, weights=weight, minlength=num_packs)

    @classmethod
    def lpt(cls, weight, kind, num_packs, items_per_pack) -> "_PackState":
        loads = np.zeros(num_packs)
        sizes = np.zeros(num_packs, dtype=np.int64)
        held = np.zeros((num_packs, int(kind.max()) + 1), dtype=bool)
        pack_of = np.empty(weight.shape[0], dtype=np.int64)
        for item in np.argsort(-weight, kind="stable"):
            room = sizes < items_per_pack
            allowed = room & ~held[:, kind[item]]
            if not allowed.any():
                allowed = room  # more replicas than packs: share a pack
            packs = np.flatnonzero(allowed)
            p = packs[np.argmin(loads[packs])]
            pack_of[item] = p
            loads[p] += weight[item]
            sizes[p] += 1
            held[p, kind[item]] = True
        return cls(weight, pack_of, num_packs)

    def swap(self, i: int, j: int) -> None:
        a, b = self.pack_of[i], self.pack_of[j]
        d = self.weight[i] - self.weight[j]
        self.loads[a] -= d
        self.loads[b] += d
        self.pack_of[i], self.pack_of[j] = b, a

    def refine_mean(self, max_swaps: int) -> None:
        tol = TOLERANCE * max(self.loads.mean(), 1e-300)
        for _ in range(max_swaps):
            a = int(np.argmax(self.loads))
            inside, outside = np.flatnonzero(self.pack_of == a), np.flatnonzero(self.pack_of != a)
            d = self.weight[inside][:, None] - self.weight[outside][None, :]  # [S, m] load leaving a
            heavier = np.maximum(self.loads[a] - d, self.loads[self.pack_of[outside]][None, :] + d)
            best = np.unravel_index(int(np.argmin(heavier)), heavier.shape)
            if not heavier[best] < self.loads[a] - tol:
                return
            self.swap(int(inside[best[0]]), int(outside[best[1]]))

    def refine_steps(self, history: np.ndarray, max_swaps: int, max_candidates: int = 4) -> None:
        num_packs = self.loads.shape[0]
        steps = np.zeros((history.shape[0], num_packs))  # [T, packs]
        for p in range(num_packs):
            steps[:, p] = history[:, self.pack_of == p].sum(axis=1)
        tol = TOLERANCE * max(steps.max(axis=1).mean(), 1e-300)
        for _ in range(max_swaps):
            peak = steps.max(axis=1)
            # packs that are the slowest in some step, most often first
            slowest = np.bincount(steps.argmax(axis=1), minlength=num_packs)
            candidates = [int(p) for p in np.argsort(-slowest, kind="stable")[:max_candidates] if slowest[p] > 0]
            for a in candidates:
                swap = self._best_step_swap(a, history, steps, peak, tol)
                if swap is not None:
                    i, j = swap
                    b = self.pack_of[j]
                    moved = history[:, i] - history[:, j]
                    steps[:, a] -= moved
                    steps[:, b] += moved
                    self.swap(i, j)
                    break
            else:
                return

    def refine_soft(self, history: np.ndarray, max_swaps: int, temp: float, max_candidates: int = 4) -> None:
        """Step 4: swaps that lower ``step_cost(steps, temp)``; of the ``max_candidates`` packs
        most often slowest, the first with an improving swap takes its best one (scored in float32 over
        [S, m, T], checked again in float64)."""
        num_packs = self.loads.shape[0]
        steps = np.zeros((history.shape[0], num_packs))
        for p in range(num_packs):
            steps[:, p] = history[:, self.pack_of == p].sum(axis=1)
        tau = np.maximum(temp * steps.mean(axis=1), 1e-300)  # [T]: swaps keep each step's mean
        inv, tau32 = (1.0 / tau).astype(np.float32), tau.astype(np.float32)
        for _ in range(max_swaps):
            cur = step_cost(steps, temp)
            tol = TOLERANCE * cur
            c = steps.max(axis=1)
            e = np.exp((steps - c[:, None]) / tau[:, None])  # [T, packs]
            total = e.sum(axis=1)
            best = None
            order = np.argsort(-np.bincount(steps.argmax(axis=1), minlength=num_packs), kind="stable")
            for a in order[:max_candidates].tolist():
                inside, outside = np.flatnonzero(self.pack_of == a), np.flatnonzero(self.pack_of != a)
                if inside.shape[0] > MAX_SWAP_OUT:
                    weight = (e[:, a] / total)[:, None] * history[:, inside]
                    inside = inside[np.argsort(-weight.sum(axis=0), kind="stable")[:MAX_SWAP_OUT]]
                b = self.pack_of[outside]
                x_in = history[:, inside].T.astype(np.float32)
                x_out = history[:, outside].T.astype(np.float32)
                moved = (x_in[:, None, :] - x_out[None, :, :]) * inv  # [S, m, T] in units of tau
                la = ((steps[:, a] - c) / tau).astype(np.float32)
                lb = ((steps[:, b].T - c[None, :]) / tau[None, :]).astype(np.float32)  # [m, T]
                rest = (total[None, :] - e[:, a][None, :] - e[:, b].T).astype(np.float32)  # [m, T]
                new = np.exp(np.minimum(la - moved, 60.0)) + np.exp(np.minimum(lb[None] + moved, 60.0))
                new += np.maximum(rest, 0.0)[None]
                score = (np.log(new) * tau32).mean(axis=-1)  # [S, m] minus mean c
                k = np.unravel_index(int(np.argmin(score)), score.shape)
                i, j = int(inside[k[0]]), int(outside[k[1]])
                move = history[:, i] - history[:, j]
                trial = steps.copy()
                trial[:, a] -= move
                trial[:, self.pack_of[j]] += move
                if step_cost(trial, temp) < cur - tol:
                    best = (i, j, trial)
                    break
            if best is None:
                return
            i, j, steps = best
            self.swap(i, j)

    def _best_step_swap(self, a, history, steps, peak, tol) -> tuple[int, int] | None:
        """The swap of an item of pack a that lowers the mean step peak most, or None.
        Candidates are scored in float32 (the [S, m, T] tensors dominate the planner's time);
        the winner's gain is checked again in float64."""
        inside, outside = np.flatnonzero(self.pack_of == a), np.flatnonzero(self.pack_of != a)
        if inside.shape[0] > MAX_SWAP_OUT:
            # only the items that load a most in the steps it is slowest are worth moving out
            is_peak = steps.argmax(axis=1) == a
            inside = inside[np.argsort(-history[is_peak][:, inside].sum(axis=0), kind="stable")[:MAX_SWAP_OUT]]
        b = self.pack_of[outside]
        rest = _peak_without(steps, a)  # [packs, T]: peak over packs other than a and b
        x_in = history[:, inside].T.astype(np.float32)  # [S, T]
        x_out = history[:, outside].T.astype(np.float32)  # [m, T]
        moved = x_in[:, None, :] - x_out[None, :, :]  # [S, m, T] load leaving a
        cost = np.maximum(steps[:, a].astype(np.float32) - moved, steps[:, b].T.astype(np.float32) + moved)
        np.maximum(cost, rest[b].astype(np.float32)[None], out=cost)
        score = cost.mean(axis=-1)  # [S, m]
        best = np.unravel_index(int(np.argmin(score)), score.shape)
        i, j = int(inside[best[0]]), int(outside[best[1]])
        move = history[:, i] - history[:, j]
        exact = np.maximum(np.maximum(steps[:, a] - move, steps[:, b[best[1]]] + move), rest[b[best[1]]]).mean()
        return (i, j) if exact < peak.mean() - tol else None


def refine_soft(history: np.ndarray, pack_of: np.ndarray, num_packs: int, temp: float,
                max_swaps: int | None = None) -> np.ndarray:
    """Swaps only, lowering the smoothed step cost (``step_cost``) of an assignment.
    history: [T, n] per-step load of each item; pack_of: [n]. Returns the new pack_of."""
    history = np.asarray(history, dtype=np.float64)
    state = _PackState(history.sum(axis=0), np.array(pack_of, dtype=np.int64), num_packs)
    state.refine_soft(history, history.shape[1] if max_swaps is None else max_swaps, temp)
    return state.pack_of


def step_cost(steps: np.ndarray, temp: float) -> float:
    """Mean over steps of each step's slowest pack, smoothed: with temp > 0 a log-sum-exp at
    temperature temp x the step's mean pack load. steps: [T, packs]."""
    c = steps.max(axis=1)
    if temp <= 0:
        return float(c.mean())
    tau = np.maximum(temp * steps.mean(axis=1), 1e-300)
    return float((c + tau * np.log(np.exp((steps - c[:, None]) / tau[:, None]).sum(axis=1))).mean())


def _peak_without(steps: np.ndarray, a: int) -> np.ndarray:
    """[packs, T]: row b is each step's heaviest pack other than a and b (-inf if none)."""
    num_steps, num_packs = steps.shape
    k = min(3, num_packs)
    top = np.argsort(-steps, axis=1, kind="stable")[:, :k]  # [T, k] three heaviest packs
    top_load = np.take_along_axis(steps, top, axis=1)
    b = np.arange(num_packs)[:, None, None]
    usable = (top[None] != a) & (top[None] != b)  # [packs, T, k]
    first = np.argmax(usable, axis=2)  # first usable of the three
    value = np.take_along_axis(np.broadcast_to(top_load, usable.shape), first[..., None], axis=2)[..., 0]
    return np.where(usable.any(axis=2), value, -np.inf)
