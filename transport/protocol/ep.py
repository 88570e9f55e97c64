"""Expert-parallel engine group: the front (``runtime/ep/engine_group.py``) and its rank
processes (``runtime/ep/rank_worker.py``).

Conventions (tags, array_like, defaults at the end, gc=False): transport/protocol/__init__.py.
"""

from __future__ import annotations

from deepinfer.transport.protocol.common import _HotMessage, _Message

# =====================================================================================
# EP group: front -> rank (the rank's stdin), rank -> front (its stdout).
# Frames: a 4-byte little-endian length, then one message. Sampling parameters and outputs ride
# as the engine's own msgpack encoding (engine/kv/handoff.py encode_params / encode_output).
# =====================================================================================


class EpGenerate(_Message):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # encode_params(SamplingParams)


class EpAbort(_Message):
    request_id: str


class EpStop(_Message):
    """Finish: the rank leaves the group and exits."""


EpRankRequest = EpGenerate | EpAbort | EpStop


class EpReady(_Message):
    """The rank's engine is built and the group formed; what the front shows as its model."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = []
    created: int = 0


class EpOutput(_HotMessage):
    request_id: str
    output: bytes  # encode_output(RequestOutput): one delta


class EpRequestFailed(_Message):
    request_id: str
    error: str  # the exception's class name (the front maps the engine's typed errors back)
    message: str


class EpRankStats(_HotMessage):
    """The rank's engine figures, sent about once a second (the front's ``stats()``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float | None = None
    ep: dict[str, float] = {}  # ExpertParallel.stats() of the rank (EngineStats.ep)


EpRankReply = EpReady | EpOutput | EpRequestFailed | EpRankStats
