"""The contract between the scheduler and the model runner: what one forward computes.

A forward is a *varlen* batch: any mix of prefill chunks, single-token decodes, speculative
verification runs and replays of many sequences. Every sequence brings

- its SWA **slot** (fixed-size per-sequence state: sliding-window K=V rows and the
  compressors' carry-over, all addressed by absolute position), and
- its **block table** (physical ids of paged blocks holding compressed rows and indexer keys):

    logical block:   0            1            2
    source tokens:   [0, bs)      [bs, 2bs)    [2bs, 3bs)     bs = block_size
    physical id:     table[0]     table[1]     table[2]
    compressed row w of a ratio-r layer (covering source [w*r, (w+1)*r))
    lives in logical block (w*r) // bs at row w % (bs // r).

Because all state is position-addressed, rolling a sequence back (speculative tokens rejected,
``num_computed_tokens`` lowered by at most ``lookahead`` positions) and recomputing from there
is exact: rows of rejected positions are simply overwritten later and the causal masks never
let a query read them before that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.engine.mm.inputs import MultiModalInput


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a forward.

    Positions ``[start_pos, start_pos + len(token_ids))`` are computed. Logits are returned for
    the last ``num_logits`` of them (1 for a decode or a final prefill chunk, 0 for a middle
    chunk, ``len(token_ids)`` for prompt logprobs, k+1 when verifying k draft tokens).

    ``window_start``: sliding-window rows at positions below it are treated as absent, i.e.
    attention windows are truncated to ``[window_start, t]``. 0 in normal operation; set to the
    first replayed position when the SWA state is rebuilt by replay.

    ``write_from``: compressed entries (and indexer keys) of windows that start below this
    position are *read* from the block cache and never recomputed or written; the compressors'
    carry-over state is still rebuilt from the replayed tokens. 0 in normal operation; the hit
    length when replaying over prefix-cache blocks.

    ``mm_inputs``: the sequence's images (engine/mm/inputs.py ``MultiModalInput``, absolute
    prompt positions); a step computing positions inside one takes their embeddings from it
    instead of the token embedding table.
    """

    seq_id: int
    slot: int
    block_table: Sequence[int]
    start_pos: int
    token_ids: Sequence[int]
    num_logits: int = 1
    window_start: int = 0
    write_from: int = 0
    mm_inputs: Sequence[MultiModalInput] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class TokenSource:
    """Token ids a forward takes from a tensor on the runner's device (the previous step's
    sampled tokens) instead of its steps' ``token_ids``, so the forward can be launched before
    the host has read them: flat token ``dst[i]`` (the batch's tokens in step order) takes
    ``tokens[index[i]]``. The steps hold any valid id at those positions (they are overwritten
    on the device); the runner never reads ``tokens`` on the host."""

    tokens: torch.Tensor  # [N] integer ids on the runner's device
    dst: Sequence[int]
    index: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.dst) != len(self.index):
            raise ValueError(f"TokenSource: {len(self.dst)} destinations for {len(self.index)} source rows")

    def write(self, token_ids: torch.Tensor) -> None:
        """``token_ids[dst] = tokens[index]`` on the device, queued on the current stream (a
        contiguous run on both sides is one copy; otherwise two small index transfers)."""
        n = len(self.dst)
        if n == 0:
            return
        src = self.tokens
        d0, i0 = self.dst[0], self.index[0]
        if _is_run(self.dst) and _is_run(self.index):
            token_ids[d0 : d0 + n].copy_(src[i0 : i0 + n], non_blocking=True)
            return
        dev = token_ids.device
        dst = torch.tensor(self.dst, dtype=torch.long).to(dev, non_blocking=True)
        index = torch.tensor(self.index, dtype=torch.long).to(dev, non_blocking=True)
        token_ids.index_copy_(0, dst, src.index_select(0, index).to(token_ids.dtype))


def _is_run(xs: Sequence[int]) -> bool:
    """True when ``xs`` is ``a, a+1, ..., a+n-1``."""
    return xs[-1] - xs[0] == len(xs) - 1 and all(b - a == 1 for a, b in zip(xs, xs[1:]))


@dataclass(slots=True)
class ForwardBatch:
    steps: list[SeqStep] = field(default_factory=list)
    # device-resident ids for some of the steps' tokens (None: every id from the steps)
    token_source: TokenSource | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.steps)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.steps)
