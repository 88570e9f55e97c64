"""Vision-encoder (VE) messages (runtime/encoder/).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

from deepinfer.transport.protocol.common import _Message


# =====================================================================================
# VE pool (owner: vision). Two channels:
#   encode RPC  ROUTER (encoder node, NodeSpec.engine) <- DEALER (gateway):
#               [rid, VeEncode, pixels] -> VeEncoded;  VeStatusRequest -> VeStatus
#               ``pixels``: one attachment, the prepared image's patches as stored bytes
#               (``pixel_dtype``, ``[grid[0] * grid[1], patch_width]``)
#   bulk        encoder BulkSender -> prefill BulkReceiver (the prefill's embedding inbox):
#               meta = encoded VeEmbeds, one buffer: the embeddings ``[num_tokens, hidden]``
# The gateway picks the encoder (runtime/balance/ve_balancer.py, pending image tokens) and the
# prefill engine; embeddings go encoder -> prefill on the data plane, never through the gateway.
# =====================================================================================


class VeEncode(_Message):
    """gateway -> encoder: encode one image and push its embeddings to ``inbox_address``."""

    request_id: str  # the gateway's request (with its attempt): the inbox key's first half
    image_index: int  # the image's place in the prompt
    grid: list[int]  # the family's shape facts (V4.1: patch rows, patch columns)
    num_tokens: int  # the image's span in the prompt
    content_hash: str
    pixel_dtype: str  # torch dtype name of the attachment ("bfloat16")
    inbox_address: str  # the prefill engine's embedding inbox (a BulkReceiver)
    timeout_s: float = 30.0  # for the bulk push


class VeStatusRequest(_Message):
    pass


VeRequest = VeEncode | VeStatusRequest


class VeEncoded(_Message):
    request_id: str
    image_index: int
    num_tokens: int
    encode_s: float  # the tower's time for this image
    num_bytes: int  # embeddings pushed to the inbox


class VeStatus(_Message):
    node_name: str
    instance_id: int
    num_pending_images: int  # queued or encoding
    num_pending_image_tokens: int
    num_encoded: int = 0  # images encoded since start


VeReply = VeEncoded | VeStatus


class VeEmbeds(_Message):
    """Meta of the encoder -> prefill bulk transfer (its one buffer: the embeddings)."""

    request_id: str
    image_index: int
    content_hash: str
    encoder_name: str
