"""The seam between the engine's speculative decoding and a model family's drafter.

A family that can draft (V4.1: engine/models/deepseek_v41/dspark_serving.py) builds a
``DraftModel`` over its target model (``ModelFamily.build_drafter``); engine/spec/ never imports a
model package. Shapes (N requests drafting, K = ``block_size`` drafts each, C = ``window``):

    take_features()                       -> (rows | None, features [n, F]) of the target's last
                                             forward (rows: which batch rows; None = 0..n-1)
    context_rows(features, positions [n]) -> [stages, n, row_width]: the rows to keep in the
                                             context ring at those positions
    propose(y [N], anchors [N], ctx [stages, N, C, row_width], valid [N, C])
                                          -> Drafts: tokens [N, K], confidence [N, K] in [0, 1]

``anchors[i]`` is the last position whose features the drafter may read (the context ends
there); ``y[i]`` is the token the target committed at ``anchors[i] + 1``; the drafts are for
positions ``anchors[i] + 2 ..``. ``confidence[i, k]``: the calibrated probability that draft k
is accepted given drafts 0..k-1 were.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Drafts(NamedTuple):
    tokens: torch.Tensor  # [N, K] int64
    logits: torch.Tensor  # [N, K] confidence logits before calibration
    confidence: torch.Tensor  # [N, K] calibrated


class DraftModel(Protocol):
    block_size: int  # K: drafts per proposal
    num_stages: int
    window: int  # C: context positions a proposal reads
    row_width: int
    device: torch.device
    dtype: torch.dtype

    def take_features(self) -> tuple[torch.Tensor | None, torch.Tensor] | None: ...

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def propose(self, y: torch.Tensor, anchors: torch.Tensor, ctx_kv: torch.Tensor,
                ctx_valid: torch.Tensor) -> Drafts: ...
