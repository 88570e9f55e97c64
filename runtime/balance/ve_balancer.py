"""The vision-encoder balancer: image-encoding work spread by pending image tokens.

Encoding time grows with an image's vision-token count (at most 1024 per image), and images of
one request are independent, so the unit of placement is the image, not the request: images are
placed largest first, each on the instance with the fewest pending image tokens counting what this
request already put there (longest-processing-time-first list scheduling). A request with four
1024-token images on four idle instances finishes encoding in one image's time instead of four.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.runtime.balance.types import VELoad, VEPlan


class VEBalancer:
    def assign(self, image_tokens: Sequence[int], loads: Sequence[VELoad]) -> VEPlan:
        if not image_tokens:
            return VEPlan(())
        if not loads:
            raise ValueError("no vision-encoder instance to encode on: the load list is empty")
        if any(n <= 0 for n in image_tokens):
            raise ValueError(f"image token counts must be positive, got {list(image_tokens)}")
        engine2pending = {load.engine_id: load.num_pending_image_tokens for load in loads}
        image2engine = [0] * len(image_tokens)
        for i in sorted(range(len(image_tokens)), key=lambda i: -image_tokens[i]):
            e = min(engine2pending, key=lambda e: (engine2pending[e], e))
            image2engine[i] = e
            engine2pending[e] += image_tokens[i]
        return VEPlan(tuple(image2engine))
