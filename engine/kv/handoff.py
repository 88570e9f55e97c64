"""Prefill -> decode handoff, engine side: capture a prefilled request, export its KV, import it.

A request is prefilled on one engine and decoded on another; the decode engine must continue
exactly where a co-located engine would. State that moves, for a prompt of P tokens with r
outputs already streamed (r = 0 unless the request resumes after losing an engine):

    all_token_ids:  p0 ... p(P-1) o0 ... o(r-1) t        t: the token the prefill sampled
                    |--- KV computed: n = P + r --|        (position n, not computed yet)
    blocks:         logical 0 .. ceil(n / bs) - 1          SWA slot: every ring, verbatim

plus the sampling state: the seed (sampling is counter-based, keyed by (seed, position), so
no generator state exists), the output tokens (penalty counts, min_tokens, grammar: the
grammar re-accepts them) and ``window_start``/``write_from`` (a prefix hit's replay bounds
stay in force for the request's life). The decode engine admits the request straight into
RUNNING with ``num_computed_tokens = n``; its next step computes position n and samples n + 1.

Prefill side: the request runs with ``max_tokens`` forced to ``r + 1`` (one new token), its
last step's block table and slot are remembered when scheduled (``KvCapture``) and read right
after that step commits, before the next step can reuse them (the scheduler has already
returned them to the pool: the host copy is what the prefill holds until the decode ack).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec
import torch

from deepinfer.engine.api.outputs import PositionLogprobs, RequestOutput
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore, StepPlan
from deepinfer.engine.core.request import RequestStatus
from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.engine.mm.inputs import MultiModalInput

BLOCK_PREFIX = "b."
SLOT_PREFIX = "s."

_params_encoder = msgspec.msgpack.Encoder()
_params_decoder = msgspec.msgpack.Decoder(SamplingParams)
_output_decoder = msgspec.msgpack.Decoder(RequestOutput)
_logprobs_decoder = msgspec.msgpack.Decoder(list[PositionLogprobs])
_prompt_logprobs_decoder = msgspec.msgpack.Decoder(list[PositionLogprobs | None])


class HandoffError(ValueError):
    """A handoff that cannot be imported (layout mismatch, bad payload); the message says why."""


class NoRoom(RuntimeError):
    """The decode engine has no free slot or blocks for the request right now."""


# ---- wire helpers (msgpack of the engine's own dataclasses; see transport/protocol.py) ----------
def encode_params(params: SamplingParams) -> bytes:
    return _params_encoder.encode(params)


def decode_params(data: bytes) -> SamplingParams:
    return _params_decoder.decode(data)


def encode_output(output: RequestOutput) -> bytes:
    return _params_encoder.encode(output)


def decode_output(data: bytes) -> RequestOutput:
    return _output_decoder.decode(data)


def encode_logprobs(logprobs) -> bytes:
    return b"" if logprobs is None else _params_encoder.encode(logprobs)


def decode_logprobs(data: bytes) -> list[PositionLogprobs] | None:
    return _logprobs_decoder.decode(data) if data else None


def decode_prompt_logprobs(data: bytes) -> list[PositionLogprobs | None] | None:
    return _prompt_logprobs_decoder.decode(data) if data else None


# ---- prefill side ------------------------------------------------------------------------------
def prefill_params(params: SamplingParams, num_resumed: int) -> SamplingParams:
    """The request as the prefill engine runs it: exactly one new token. ``min_tokens`` is
    clipped to stay valid; the sampler still masks EOS at that one position iff the original
    ``min_tokens`` would (``num_resumed < min(min_tokens, num_resumed + 1)``)."""
    limit = num_resumed + 1
    return replace(params, max_tokens=limit, min_tokens=min(params.min_tokens, limit))


def ends_at_prefill(out: RequestOutput, params: SamplingParams, num_outputs: int, num_tokens: int,
                    max_model_len: int) -> bool:
    """True when the prefill's finished output also ends the real request (EOS, a stop token or
    string, the real max_tokens or the context limit), so no handoff happens."""
    reason = out.outputs[0].finish_reason
    if reason != "length":
        return True
    return (params.max_tokens is not None and num_outputs >= params.max_tokens) or num_tokens >= max_model_len


@dataclass(frozen=True, slots=True)
class CapturedKv:
    """Where a just-finished prefill's KV sits (blocks already back in the pool, unmodified
    until the next step executes)."""

    block_ids: tuple[int, ...]
    slot: int
    num_computed_tokens: int
    window_start: int
    write_from: int


class KvCapture:
    """Remembers the block table and slot of watched requests' sampling steps."""

    def __init__(self) -> None:
        self._watched: set[str] = set()
        self._rid2kv: dict[str, CapturedKv] = {}

    def watch(self, request_id: str) -> None:
        self._watched.add(request_id)

    def forget(self, request_id: str) -> None:
        self._watched.discard(request_id)
        self._rid2kv.pop(request_id, None)

    def on_scheduled(self, plan: StepPlan, block_size: int) -> None:
        """Call after ``schedule_step``: the tables are the lists the scheduler handed out, so
        they stay valid after the request releases them (release replaces the list)."""
        if not self._watched:
            return
        for s in plan.sched.scheduled:
            if s.num_sample_rows and s.request_id in self._watched:
                step = s.step
                num_blocks = -(-step.end_pos // block_size)
                self._rid2kv[s.request_id] = CapturedKv(tuple(step.block_table[:num_blocks]), step.slot,
                                                        step.end_pos, step.window_start, step.write_from)

    def take(self, request_id: str) -> CapturedKv | None:
        self._watched.discard(request_id)
        return self._rid2kv.pop(request_id, None)


@dataclass(slots=True)
class KvPayload:
    """A request's KV as host tensors, in wire order (names ``b.<layer>.<kind>``/``s.<...>``)."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def export_kv(runner, kv: CapturedKv) -> KvPayload:
    """Host copies of the captured blocks and slot (runner API: read_blocks / read_slot)."""
    names, tensors = [], []
    for name, t in runner.read_blocks(list(kv.block_ids)).items():
        names.append(BLOCK_PREFIX + name)
        tensors.append(t.contiguous())
    for name, t in runner.read_slot(kv.slot).items():
        names.append(SLOT_PREFIX + name)
        tensors.append(t.contiguous())
    return KvPayload(names, tensors)


# ---- decode side -------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefilledRequest:
    """Everything the decode engine needs to continue a request (a decoded PdKvPush + its KV)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # resumed + the token the prefill sampled (>= 1)
    params: SamplingParams
    seed: int
    num_computed_tokens: int
    kv: KvPayload
    window_start: int = 0
    write_from: int = 0
    first_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt: str | None = None
    mm_inputs: Sequence[MultiModalInput] = ()  # the prompt's images (split_image_embeddings)

    def __post_init__(self) -> None:
        expected = len(self.prompt_token_ids) + len(self.output_token_ids) - 1
        if not self.output_token_ids or self.num_computed_tokens != expected:
            raise HandoffError(f"request {self.request_id!r}: {self.num_computed_tokens} computed tokens for "
                               f"{len(self.prompt_token_ids)} prompt + {len(self.output_token_ids)} output tokens")


EMBED_PREFIX = "e."  # a handed-off request's image embeddings ride with its KV: "e.<image index>"


def with_image_embeddings(payload: KvPayload, mm_inputs: Sequence[MultiModalInput]) -> KvPayload:
    """The KV plus each image's embeddings: a decode engine that must recompute the prompt (a
    preemption) has what the image positions need."""
    if not mm_inputs:
        return payload
    embeds = [mm.embeds.detach().to("cpu").contiguous() for mm in mm_inputs]
    return KvPayload(payload.names + [f"{EMBED_PREFIX}{i}" for i in range(len(embeds))], payload.tensors + embeds)


def split_image_embeddings(payload: KvPayload, spans: Sequence[MultiModalSpan]) -> tuple[KvPayload, list[MultiModalInput]]:
    """(the KV alone, the images with their embeddings copied out of the transfer); HandoffError
    when the embeddings do not match the spans."""
    kv, embeds = KvPayload([], []), {}
    for name, t in zip(payload.names, payload.tensors):
        if name.startswith(EMBED_PREFIX):
            embeds[name[len(EMBED_PREFIX):]] = t
        else:
            kv.names.append(name)
            kv.tensors.append(t)
    if sorted(embeds) != sorted(str(i) for i in range(len(spans))):
        raise HandoffError(f"the handoff carries embeddings {sorted(embeds)} for {len(spans)} image span(s)")
    inputs = []
    for i, span in enumerate(spans):
        e = embeds[str(i)]
        if e.dim() != 2 or e.shape[0] != span.length:
            raise HandoffError(f"image {i}'s embeddings have shape {tuple(e.shape)}, its span is {span.length} tokens")
        inputs.append(MultiModalInput(span, e.clone()))
    return kv, inputs


def has_room(core: EngineCore, num_tokens: int) -> bool:
    sched = core.scheduler
    num_blocks = -(-(num_tokens + 1) // sched.config.block_size)
    return (len(sched.running) < sched.config.max_num_seqs and sched.slots.num_free_slots > 0
            and sched.pool.num_allocatable_with([]) >= num_blocks)


def add_resumed(core: EngineCore, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                seed: int, resumed: list[int], mm_inputs: Sequence[MultiModalInput] = ()) -> None:
    """Queue a request whose first ``resumed`` outputs were generated (and streamed) elsewhere:
    it recomputes their KV and samples what comes next, as if it had never moved. ``mm_inputs``:
    the prompt's images (without embeddings on a decode engine: their KV came with the handoff)."""
    core.add_request(request_id, prompt_token_ids, replace(params, seed=seed), mm_inputs=mm_inputs)
    if resumed:
        core.prime_outputs(request_id, resumed, emit=False)


def admit_prefilled(core: EngineCore, pre: PrefilledRequest) -> RequestOutput | None:
    """Admit ``pre`` straight into RUNNING with its KV imported; returns the delta of the token
    the prefill sampled (the first one the client sees from this attempt). Raises ``NoRoom``
    (nothing changed) when no slot or blocks are free, ``HandoffError`` on a bad payload."""
    sched = core.scheduler
    n = pre.num_computed_tokens
    if n + 1 >= sched.config.max_model_len:
        raise HandoffError(f"request {pre.request_id!r}: {n + 1} tokens exceed max_model_len {sched.config.max_model_len}")
    if not has_room(core, n):
        raise NoRoom(f"no free slot or {-(-(n + 1) // sched.config.block_size)} free blocks for {pre.request_id!r}")
    blocks, slot = _split_payload(core, pre)
    resumed, first = pre.output_token_ids[:-1], pre.output_token_ids[-1:]
    add_resumed(core, pre.request_id, pre.prompt_token_ids, pre.params, pre.seed, resumed, pre.mm_inputs)
    delta = core.prime_outputs(pre.request_id, first, pre.first_logprobs, emit=True)
    req = sched.requests.get(pre.request_id)
    if req is None:  # a stop string ended it on the handed-over token
        return delta
    # Narrow use of scheduler state (no admit-with-KV verb yet): move the request from waiting to
    # running exactly as _admit_waiting would after a full prefix hit, with its own new blocks.
    sched.waiting.remove(req)
    if not sched.kv.admit(req, [], n + 1):
        sched.waiting.push(req)
        core.abort([pre.request_id])
        raise NoRoom(f"blocks for {pre.request_id!r} vanished while admitting")
    num_blocks = len(next(iter(blocks.values()))) if blocks else 0
    core.runner.write_blocks(req.block_ids[:num_blocks], blocks)
    core.runner.write_slot(req.slot, slot)
    req.num_computed_tokens = n
    req.window_start, req.write_from = pre.window_start, pre.write_from
    req.num_cached_tokens = 0
    req.status = RequestStatus.RUNNING
    bisect.insort(sched.running, req, key=lambda r: r.sort_key)
    sched.kv.register_blocks(req, n, write_behind=False)  # the prefill wrote the prompt's blocks behind
    if delta is not None and pre.prompt_logprobs is not None:
        delta.prompt_logprobs = pre.prompt_logprobs
    return delta


def _split_payload(core: EngineCore, pre: PrefilledRequest) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    layout = core.runner.kv_layout()
    bs = layout.block_size
    blocks: dict[str, torch.Tensor] = {}
    slot: dict[str, torch.Tensor] = {}
    for name, t in zip(pre.kv.names, pre.kv.tensors):
        if name.startswith(BLOCK_PREFIX):
            blocks[name[len(BLOCK_PREFIX):]] = t
        elif name.startswith(SLOT_PREFIX):
            slot[name[len(SLOT_PREFIX):]] = t
        else:
            raise HandoffError(f"request {pre.request_id!r}: KV buffer {name!r} is neither b.* nor s.*")
    want_blocks = {t.name: (-(-pre.num_computed_tokens // bs), *t.shape) for t in layout.block_tensors}
    want_slot = {t.name: t.shape for t in layout.slot_tensors}
    for got, want, what in ((blocks, want_blocks, "block"), (slot, want_slot, "slot")):
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise HandoffError(f"request {pre.request_id!r}: {what} tensors differ from this engine's layout "
                               f"(missing {missing[:3]}, unexpected {extra[:3]}): prefill and decode run different models")
        for name, t in got.items():
            if tuple(t.shape) != tuple(want[name]) or t.dtype != layout.dtype:
                raise HandoffError(f"request {pre.request_id!r}: {what} tensor {name} is {tuple(t.shape)} {t.dtype}, "
                                   f"this engine expects {tuple(want[name])} {layout.dtype}")
    return blocks, slot
