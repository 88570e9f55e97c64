"""What each layer of a V4.1 model does, from ``compress_ratios`` and the source lists.

    ratio 0        window only (sliding-window attention)
    ratio 2        "encoder": compressed KV pools pairs of tokens (a gate softmax over the pair)
    ratio 1        "decoder": one compressed row per token; the first decoder kv source (the
                   CED source) projects it from the previous layer's output

A compressed layer L reads the compressed cache of its *kv source* (the latest kv source at or
below L) and attends the rows its *index source* (the latest index source at or below L) picked
in the same step. Roles:

    Full      L is a kv source: owns a compressor, the paged rows and the index keys, and an
              indexer that scores them (kv sources are index sources)
    Reindex   L is an index source but not a kv source: its own indexer query scores its kv
              source's keys, inside the candidate pool when the candidate source is below it
    Reuse     neither: attends the picks of its index source

The candidate source (an index source) publishes per query the top ``candidate_topk_blocks``
blocks of ``candidate_block_size`` compressed positions (the block holding its newest position
always kept); index sources above it score only inside that pool.

``check_roles`` raises ``RoleError`` naming the first broken invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALLOWED_RATIOS = (0, 1, 2)


class RoleError(ValueError):
    """compress_ratios and the source lists do not describe a consistent layer layout."""


@dataclass(frozen=True, slots=True)
class LayerRole:
    layer: int
    ratio: int  # 0 window only, 2 pooled pairs, 1 one row per token
    kv_source: int | None  # layer whose compressed cache this layer reads (None: window only)
    index_source: int | None  # layer whose top-k this layer attends
    uses_candidates: bool  # an index source scoring inside the candidate pool
    is_candidate_source: bool
    has_engram: bool

    @property
    def is_kv_source(self) -> bool:
        return self.ratio > 0 and self.kv_source == self.layer

    @property
    def is_index_source(self) -> bool:
        return self.ratio > 0 and self.index_source == self.layer

    @property
    def name(self) -> str:
        if not self.ratio:
            return "window"
        if self.is_kv_source:
            return "full"
        return "reindex" if self.is_index_source else "reuse"


def layer_roles(
    ratios: Sequence[int],
    kv_sources: Sequence[int],
    index_sources: Sequence[int],
    candidate_source: int,
    engram_layers: Sequence[int],
) -> tuple[LayerRole, ...]:
    """Roles of the backbone layers ``0 .. len(ratios) - 1`` (call ``check_roles`` first)."""
    roles = []
    for layer, ratio in enumerate(ratios):
        kv = max((s for s in kv_sources if s <= layer), default=None) if ratio else None
        ix = max((s for s in index_sources if s <= layer), default=None) if ratio else None
        is_index = ratio > 0 and ix == layer
        roles.append(LayerRole(
            layer=layer,
            ratio=ratio,
            kv_source=kv,
            index_source=ix,
            uses_candidates=is_index and 0 <= candidate_source < layer,
            is_candidate_source=layer == candidate_source,
            has_engram=layer in engram_layers,
        ))
    return tuple(roles)


def check_roles(
    ratios: Sequence[int],
    stage_ratios: Sequence[int],
    kv_sources: Sequence[int],
    index_sources: Sequence[int],
    candidate_source: int,
) -> None:
    """The layout invariants a V4.1 config must satisfy (module docstring)."""
    n = len(ratios)
    for i, r in enumerate([*ratios, *stage_ratios]):
        if r not in ALLOWED_RATIOS:
            raise RoleError(f"compress_ratios[{i}] is {r}; V4.1 layers have ratio 0, 1 or 2")
    for i, r in enumerate(stage_ratios):
        if r:
            raise RoleError(f"compress_ratios[{n + i}] is {r}: DSpark stages attend their window only (ratio 0)")
    for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        if list(ids) != sorted(set(ids)):
            raise RoleError(f"{name} {list(ids)} must be strictly increasing")
        for s in ids:
            if not 0 <= s < n or ratios[s] == 0:
                raise RoleError(f"{name} lists layer {s}, which is not a compressed backbone layer")
    compressed = [i for i, r in enumerate(ratios) if r]
    if compressed and (not kv_sources or kv_sources[0] != compressed[0]):
        raise RoleError(f"the first compressed layer ({compressed[0]}) must be a kv source (kv_source_layer_ids "
                        f"{list(kv_sources)}): every compressed layer reads the latest kv source at or below it")
    for s in kv_sources:
        if s not in index_sources:
            raise RoleError(f"kv source {s} must be an index source too: its index keys are scored there first")
    for layer in compressed:
        kv = max(s for s in kv_sources if s <= layer)
        if ratios[kv] != ratios[layer]:
            raise RoleError(f"layer {layer} has ratio {ratios[layer]} but reads kv source {kv} of ratio {ratios[kv]}; "
                            "the ratio must be constant inside each sharing group")
    if candidate_source >= 0:
        if candidate_source not in index_sources:
            raise RoleError(f"candidate_source_layer_id {candidate_source} must be an index source")
        group = max(s for s in kv_sources if s <= candidate_source)
        for s in index_sources:
            if s > candidate_source and max(k for k in kv_sources if k <= s) != group:
                raise RoleError(f"index source {s} scores inside the candidate pool of layer {candidate_source}, "
                                f"so it must read the same kv source ({group})")
