"""Start-up calibration of the SPS table: time real verify steps and drafter passes on this device.

For each request count R of the grid (powers of 4 up to the engine's ``max_num_seqs``, which is
always included) and each draft depth L of ``depths``, one forward of R sequences at ``context``
computed positions, each computing 1 + L tokens with 1 + L logit rows, plus the greedy argmax
over those rows (the sampler's cheapest pass; what verification costs at least), timed after
one warm-up; and one drafter pass over R proposals. Everything runs through the engine's own
model runner and drafter, before the engine takes requests: the scratch sequences use slots
0..R-1 and the first blocks of the pool, which no request holds yet (every later request writes
its positions before reading them).

Timings on a shared machine are noisy and the noise moves with the load from minute to minute,
so one table of fastest timings gave the scheduler different choices in every run. Now every point
(a target step of R requests x depth L, or a drafter pass over R proposals) is warmed up once,
then timed once per round for ``rounds`` rounds, all points of a round in a shuffled order (a burst
of load hits random points, not one end of the grid). Per R, step time is fitted as a line
``a_R + b_R B`` to the points' medians (sps_fit.py); the drafter keeps its median. The fitted
table then gets the envelope ``t(R, L) = min over R' >= R, L' >= L of t(R', L')``: a step of R
requests verifying L drafts each can always be padded to R' requests of L' drafts, so that time
is achievable (the same holds for the drafter's pass over R proposals). About
``len(grid) x (len(depths) + 1) x (rounds + 1)`` forwards.

The drafter's pass is timed with torch's intra-op thread count and, when that is more than one,
with a single thread too (interleaved like every other point); per R the faster median is kept,
and with it the thread count the proposer runs that pass with (``SpsTable.draft_threads``).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Sequence
from functools import partial

import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.spec.draft_model import DraftModel
from deepinfer.engine.spec.proposer import intra_op_threads
from deepinfer.engine.spec.sps_fit import fit_step_table
from deepinfer.engine.spec.sps_table import SpsTable

log = logging.getLogger(__name__)

DEFAULT_DEPTHS = (0, 1, 3, 5)


def request_grid(max_num_seqs: int, *, base: int = 4) -> list[int]:
    grid, r = [], 1
    while r < max_num_seqs:
        grid.append(r)
        r *= base
    grid.append(max_num_seqs)
    return grid


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def draft_thread_options() -> list[int]:
    """Intra-op thread counts the drafter's pass is timed with: torch's, and 1 when that is more."""
    n = torch.get_num_threads()
    return [n] if n <= 1 else [n, 1]


@torch.inference_mode()
def calibrate_sps(runner, draft_model: DraftModel, *, max_num_seqs: int, num_blocks: int, block_size: int,
                  max_depth: int, context: int = 256, depths: Sequence[int] = DEFAULT_DEPTHS,
                  grid: Sequence[int] | None = None, rounds: int = 5, seed: int = 0,
                  graphed_pass=None) -> SpsTable:
    """Time the grid on ``runner`` (the plain ModelRunner, not a wrapper) and ``draft_model``:
    one warm-up per point, then ``rounds`` interleaved timings, fitted per R (module docstring).
    ``graphed_pass``: the proposer's ``GraphedProposals`` (CUDA graphs of the pass), timed instead
    of ``draft_model.propose`` so the table holds what serving runs (slots 0..R-1 of its ring)."""
    if rounds < 1:
        raise ValueError(f"SPS calibration needs >= 1 round of timings, got {rounds}")
    depths = sorted({d for d in depths if d <= max_depth} | {0, max_depth})
    grid = list(grid) if grid is not None else request_grid(max_num_seqs)
    blocks_per_seq = -(-(context + max_depth + 1) // block_size)
    fit = num_blocks // blocks_per_seq
    if fit < 1:
        raise ValueError(f"the KV pool ({num_blocks} blocks) holds no calibration sequence of {context} tokens")
    grid = sorted({min(r, fit, max_num_seqs) for r in grid})
    vocab = getattr(runner.config, "vocab_size", 2)
    token = min(5, vocab - 1)
    dev = draft_model.device
    thread_options = draft_thread_options()
    points = []  # (request count, verify tokens of a target step or None for the drafter, threads, the timed call)
    for r in grid:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(r)]
        for depth in depths:
            n = 1 + depth
            batch = ForwardBatch([SeqStep(i, i, tables[i], context, [token] * n, n) for i in range(r)])

            def step(batch=batch):
                runner.execute(batch).argmax(dim=-1).cpu()

            points.append((r, r * n, None, step))
        if graphed_pass is not None:
            propose = partial(graphed_pass, [token] * r, [context] * r, list(range(r)))
        else:
            y = torch.full((r,), token, dtype=torch.int64, device=dev)
            anchors = torch.full((r,), context, dtype=torch.int64, device=dev)
            ctx = torch.zeros(draft_model.num_stages, r, draft_model.window, draft_model.row_width,
                              dtype=draft_model.dtype, device=dev)
            valid = torch.ones(r, draft_model.window, dtype=torch.bool, device=dev)
            propose = partial(draft_model.propose, y, anchors, ctx, valid)

        for threads in thread_options:

            def draft(propose=propose, threads=threads):
                with intra_op_threads(threads):
                    propose().confidence.cpu()

            points.append((r, None, threads, draft))
    timings: dict[int, dict[int, list[float]]] = {r: {} for r in grid}
    draft_timings: dict[tuple[int, int], list[float]] = {}
    for *_, fn in points:  # warm-up (allocations, first-call dispatch)
        fn()
    order = random.Random(seed)
    for _ in range(rounds):
        for r, b, threads, fn in order.sample(points, len(points)):
            seconds = _time_once(fn)
            (draft_timings.setdefault((r, threads), []) if b is None else timings[r].setdefault(b, [])).append(seconds)
    draft_model.take_features()  # the scratch forwards' features are nobody's
    steps_s, lines = fit_step_table(timings)
    draft_s, draft_threads = fastest_drafter(draft_timings)
    for r, line in lines.items():
        log.info("SPS fit R=%d: %.3f ms + %.4f ms/token (spread %.0f %%), drafter %.3f ms at %d thread(s)", r,
                 line.intercept * 1e3, line.slope * 1e3, line.spread * 100, draft_s[r] * 1e3, draft_threads[r])
    steps_s, draft_s = padding_envelope(steps_s, draft_s, depths)
    return SpsTable(steps_s, draft_s, max_depth=max_depth, device=str(dev), draft_threads=draft_threads)


def fastest_drafter(timings: dict[tuple[int, int], list[float]]) -> tuple[dict[int, float], dict[int, int]]:
    """``timings[(R, threads)]`` -> per R the smallest median over the thread counts, and that count
    (ties: the larger count)."""
    seconds: dict[int, float] = {}
    threads: dict[int, int] = {}
    for (r, n), ts in sorted(timings.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        med = float(statistics.median(ts))
        if r not in seconds or med < seconds[r]:
            seconds[r], threads[r] = med, n
    return seconds, threads


def padding_envelope(steps_s: dict[int, dict[int, float]], draft_s: dict[int, float],
                     depths: Sequence[int]) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """``t(R, L) = min over R' >= R, L' >= L of t(R', L')`` (keys ``B = R (1 + L)``) and the
    drafter's ``d(R) = min over R' >= R of d(R')``."""
    grid = sorted(steps_s)
    depths = sorted(depths)
    env: dict[int, dict[int, float]] = {r: {} for r in grid}
    env_draft: dict[int, float] = {}
    best_draft = float("inf")
    above = [float("inf")] * len(depths)  # the envelope of the request counts above r, per depth
    for r in reversed(grid):
        run = float("inf")
        for i in range(len(depths) - 1, -1, -1):
            b = r * (1 + depths[i])
            run = min(run, steps_s[r][b], above[i])
            env[r][b] = run
            above[i] = run
        best_draft = env_draft[r] = min(best_draft, draft_s[r])
    return env, env_draft
