"""Image spans in a prompt: expand each placeholder into its span, and check that a prompt's image
positions are exactly its images' spans.

    prompt ids:   ... t  IMG  t t  IMG  t ...              one image token per image (the template's)
    expanded:     ... t  IMG x n0  t t  IMG x n1  t ...    n_i = image i's span (PreparedImage.num_tokens)
    spans:            (offset_0, n0)      (offset_1, n1)

Every span position carries the image token id; the embeddings that replace them come with the
image (``MultiModalInput``). The engine core calls ``check_image_positions`` once per request,
whoever expanded the prompt (``AsyncEngine``, a disaggregated gateway).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.engine.mm.inputs import ImageInputError, MultiModalInput, PreparedImage


def expand_image_tokens(prompt_ids: Sequence[int], image_token_id: int, images: Sequence[PreparedImage],
                        placeholder: str) -> tuple[list[int], list[MultiModalSpan]]:
    """(expanded ids, one span per image in prompt order) from one placeholder token per image,
    or from a prompt already expanded (a gateway that priced the images): each image's run of
    ``num_tokens`` image tokens in order. A span has at least 4 positions, so the two never mix."""
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if images and len(positions) == sum(im.num_tokens for im in images) != len(images):
        return list(prompt_ids), _expanded_spans(prompt_ids, image_token_id, images)
    if len(positions) != len(images):
        raise ImageInputError(f"the prompt has {len(positions)} image placeholder(s) ({placeholder}) for "
                              f"{len(images)} image(s); put one placeholder where each image goes")
    ids: list[int] = []
    spans: list[MultiModalSpan] = []
    last = 0
    for pos, image in zip(positions, images):
        ids.extend(prompt_ids[last:pos])
        spans.append(MultiModalSpan(len(ids), image.num_tokens, image.content_hash))
        ids.extend([image_token_id] * image.num_tokens)
        last = pos + 1
    ids.extend(prompt_ids[last:])
    return ids, spans


def _expanded_spans(prompt_ids: Sequence[int], image_token_id: int,
                    images: Sequence[PreparedImage]) -> list[MultiModalSpan]:
    spans, at = [], 0
    for i, image in enumerate(images):
        at = next(p for p in range(at, len(prompt_ids)) if prompt_ids[p] == image_token_id)
        run = prompt_ids[at:at + image.num_tokens]
        if len(run) != image.num_tokens or any(t != image_token_id for t in run):
            raise ImageInputError(f"image {i} needs {image.num_tokens} image tokens from position {at}; the expanded "
                                  "prompt has another run there")
        spans.append(MultiModalSpan(at, image.num_tokens, image.content_hash))
        at += image.num_tokens
    return spans


def check_image_positions(prompt_ids: Sequence[int], image_token_id: int | None,
                          mm_inputs: Sequence[MultiModalInput], hidden_size: int | None = None) -> None:
    """Raise ``ImageInputError`` unless the positions holding ``image_token_id`` are exactly the
    spans of ``mm_inputs`` (in order, inside the prompt, not overlapping) and each span's
    embeddings, when given, are ``[length, hidden_size]``."""
    if image_token_id is None:
        if mm_inputs:
            raise ImageInputError("this model has no vision tower; send text only")
        return
    if not mm_inputs:
        if image_token_id in prompt_ids:
            raise ImageInputError(f"the prompt holds the image token {image_token_id} but no image; image tokens come "
                                  "only from images")
        return
    covered = 0
    end = 0
    n = len(prompt_ids)
    for i, mm in enumerate(mm_inputs):
        span = mm.span
        if span.length < 1 or span.offset < end or span.offset + span.length > n:
            raise ImageInputError(f"image {i}'s span [{span.offset}, {span.offset + span.length}) is empty, overlaps "
                                  f"the one before it or passes the prompt's {n} tokens")
        if any(t != image_token_id for t in prompt_ids[span.offset:span.offset + span.length]):
            raise ImageInputError(f"image {i}'s span [{span.offset}, {span.offset + span.length}) holds tokens other "
                                  f"than the image token {image_token_id}")
        if mm.embeds is not None:
            want = (span.length, hidden_size) if hidden_size is not None else (span.length, mm.embeds.shape[-1])
            if tuple(mm.embeds.shape) != want:
                raise ImageInputError(f"image {i}'s embeddings have shape {tuple(mm.embeds.shape)}, its span needs "
                                      f"{want}")
        covered += span.length
        end = span.offset + span.length
    num_image_tokens = sum(1 for t in prompt_ids if t == image_token_id)
    if num_image_tokens != covered:
        raise ImageInputError(f"the prompt holds the image token {image_token_id} at {num_image_tokens} positions but "
                              f"its images span {covered}; image tokens come only from images")
