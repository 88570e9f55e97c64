"""Start-up calibration of the SPS table: time real verify steps and drafter passes on this device.

For each request count R of the grid (powers of 4 up to the engine's ``max_num_seqs``, which is
always included) and each draft depth L of ``depths``, one forward of R sequences at ``context``
computed positions, each computing 1 + L tokens with 1 + L logit rows, plus the greedy argmax
over those rows (the sampler's cheapest pass; what verification costs at least), timed after
one warm-up; and one drafter pass over R proposals. Everything runs through the engine's own
model runner and drafter, before the engine takes requests: the scratch sequences use slots
0..R-1 and the first blocks of the pool, which no request holds yet (every later request writes
its positions before reading them).

Noise only ever adds time (another process on the cores, a first call's allocations), so each
point keeps its fastest of ``reps`` timings over ``passes`` sweeps of the whole grid (a burst of
load hits different points in each sweep), and the table keeps the envelope
``t(R, L) = min over R' >= R, L' >= L of t(R', L')``: a step of R requests verifying L drafts each
can always be padded to R' requests of L' drafts, so that time is achievable (the same holds
for the drafter's pass over R proposals). About ``passes x len(grid) x (len(depths) + 1) x
(reps + 1)`` forwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.spec.draft_model import DraftModel
from deepinfer.engine.spec.sps_table import SpsTable

DEFAULT_DEPTHS = (0, 1, 3, 5)


def request_grid(max_num_seqs: int, *, base: int = 4) -> list[int]:
    grid, r = [], 1
    while r < max_num_seqs:
        grid.append(r)
        r *= base
    grid.append(max_num_seqs)
    return grid


def _timed(fn, reps: int) -> float:
    fn()  # warm-up (allocations, first-call dispatch)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def calibrate_sps(runner, draft_model: DraftModel, *, max_num_seqs: int, num_blocks: int, block_size: int,
                  max_depth: int, context: int = 256, depths: Sequence[int] = DEFAULT_DEPTHS,
                  grid: Sequence[int] | None = None, reps: int = 2, passes: int = 2) -> SpsTable:
    """Time the grid on ``runner`` (the plain ModelRunner, not a wrapper) and ``draft_model``:
    per point the fastest of ``reps`` timings after a warm-up, over ``passes`` sweeps, then the
    padding envelope (module docstring)."""
    depths = sorted({d for d in depths if d <= max_depth} | {0, max_depth})
    grid = list(grid) if grid is not None else request_grid(max_num_seqs)
    blocks_per_seq = -(-(context + max_depth + 1) // block_size)
    fit = num_blocks // blocks_per_seq
    if fit < 1:
        raise ValueError(f"the KV pool ({num_blocks} blocks) holds no calibration sequence of {context} tokens")
    grid = sorted({min(r, fit, max_num_seqs) for r in grid})
    vocab = getattr(runner.config, "vocab_size", 2)
    token = min(5, vocab - 1)
    steps_s: dict[int, dict[int, float]] = {}
    draft_s: dict[int, float] = {}
    dev = draft_model.device
    for r in [r for _ in range(passes) for r in grid]:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(r)]
        row = {}
        for depth in depths:
            n = 1 + depth
            batch = ForwardBatch([SeqStep(i, i, tables[i], context, [token] * n, n) for i in range(r)])

            def step(batch=batch):
                runner.execute(batch).argmax(dim=-1).cpu()

            row[r * n] = min(_timed(step, reps), steps_s.get(r, {}).get(r * n, float("inf")))
        draft_model.take_features()  # the scratch forwards' features are nobody's
        steps_s[r] = row
        y = torch.full((r,), token, dtype=torch.int64, device=dev)
        anchors = torch.full((r,), context, dtype=torch.int64, device=dev)
        ctx = torch.zeros(draft_model.num_stages, r, draft_model.window, draft_model.row_width,
                          dtype=draft_model.dtype, device=dev)
        valid = torch.ones(r, draft_model.window, dtype=torch.bool, device=dev)

        def draft(y=y, anchors=anchors, ctx=ctx, valid=valid):
            draft_model.propose(y, anchors, ctx, valid).confidence.cpu()

        draft_s[r] = min(_timed(draft, reps), draft_s.get(r, float("inf")))
    steps_s, draft_s = padding_envelope(steps_s, draft_s, depths)
    return SpsTable(steps_s, draft_s, max_depth=max_depth, device=str(dev))


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
