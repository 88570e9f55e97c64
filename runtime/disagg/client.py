"""The gateway's ``EngineClient`` for a disaggregated cluster (engine/api/protocol.py).

``generate`` picks a prefill and a decode engine together from their load reports (routing.py:
by default the tiered router over the prefix index the engines' cache events feed, with the KV
store's presence, and the two-dimensional decode balancer; ``"round-robin"`` or
``"affinity-only"`` for the baselines), sends ``PdDispatch`` to the prefill and yields the deltas
the decode engine streams back (or the prefill's final delta when the first token ends the
request), with the prompt tokens the prefill found cached. Each try is an *attempt*; engine
request ids are ``<id>@<attempt>``, so outputs of an abandoned attempt are never mixed in.

An attempt is lost when its prefill or decode instance goes down (heartbeats), when the prefill
reports a failed handoff, or when the decode engine reports a failed request. Policy:
``RECOMPUTE`` (default): a new attempt on up engines, excluding the lost ones, carrying the tokens
already streamed (``resume_token_ids``; sampling is counter-based, so the continuation equals
what the lost engine would have produced); ``FAIL``: ``EngineLostError`` naming the lost engine.
An abort meant for an engine that is down (a cut link) waits until it is up again
(``MAX_PENDING_ABORTS`` per engine), so an engine that rejoins drops the attempts it still runs.

No request outlives ``request_timeout_s``: every wait is bounded by the request's deadline. A
decode that acknowledged a handoff sends the request's first delta at once (before the ack), so
an attempt whose decode stays silent for ``decode_silence_s`` after the prefill's ``HANDED_OFF``
is lost too (the KV or the stream went astray while the engine looks alive): recomputed or failed
by the same policy instead of hanging until the deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.protocol import EngineStats, GatewayTokenizer, InvalidPromptError, ModelInfo, TokensPrompt
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.kv.handoff import decode_output, encode_params
from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.mm.prompt import ImagePrompt, prepare_prompt_images
from deepinfer.runtime.balance import PrefillRouterConfig
from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole
from deepinfer.runtime.disagg.engine_directory import EngineDirectory, EngineEntry
from deepinfer.runtime.disagg.prefill import engine_request_id
from deepinfer.runtime.disagg.routing import RouterCollector, Routing
from deepinfer.runtime.encoder.pool import EncoderPool, EncoderRef, EncoderUnavailable, ImageRefused
from deepinfer.transport.channels import StreamReceiver
from deepinfer.transport.errors import RemoteError, TransportError
from deepinfer.transport.protocol import (
    ErrorCode,
    FailurePolicy,
    HandoffStatus,
    PdAbort,
    PdDispatch,
    PdFailed,
    PdImage,
    PdStream,
    PeerDown,
    PeerUp,
)

log = logging.getLogger(__name__)

# the prefill engine's typed input errors, by name (the engine checks the prompt; RemoteError carries the name)
_PROMPT_ERRORS = ("InvalidPromptError", "SchedulerError")
_INPUT_ERRORS = ("ValueError", "SamplingParamsError", "StructuredOutputError", *_PROMPT_ERRORS)
MAX_PENDING_ABORTS = 4096  # per engine that is down


class EngineLostError(RuntimeError):
    """A request's engine was lost and the failure policy (or the deadline) forbids a retry."""


class _AttemptLost(Exception):
    def __init__(self, message: str, engine: str):
        super().__init__(message)
        self.engine = engine


@dataclass(slots=True)
class _Attempt:
    request_id: str
    number: int
    prefill: EngineEntry
    decode: EngineEntry
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    lost: asyncio.Future | None = None


class PdEngineClient:
    def __init__(self, cluster: ClusterConfig, *, gateway_name: str, model_info: ModelInfo,
                 tokenizer: GatewayTokenizer | None = None, failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE,
                 request_timeout_s: float = 300.0, max_attempts: int = 4, decode_silence_s: float = 15.0,
                 ctx=None, seed: int | None = None, routing: str = "tiered", default_traffic_class: str = "",
                 router_config: PrefillRouterConfig | None = None, vision: VisionEncoder | None = None):
        """``default_traffic_class``: the KV store's TTL class of requests that name none ("" = the engines').
        ``vision``: the model's image preprocessing (no tower) when it reads images; their
        embeddings come from the cluster's encoder nodes (runtime/encoder/pool.py)."""
        spec = cluster.node(gateway_name)
        if not spec.data:
            raise ValueError(f"nodes.{gateway_name}.data: the gateway needs a data address for the engines' streams")
        self.gateway_name = gateway_name
        self.instance_id = secrets.randbits(63)
        self.failure_policy = FailurePolicy(failure_policy)
        self.request_timeout_s = request_timeout_s
        if decode_silence_s <= 0:
            raise ValueError(f"decode_silence_s must be > 0, got {decode_silence_s}")
        self.decode_silence_s = decode_silence_s
        self.max_attempts = max_attempts
        self.default_traffic_class = default_traffic_class
        self._model_info = model_info
        self._tokenizer = tokenizer
        self.directory = EngineDirectory(cluster, ctx=ctx, name=gateway_name)
        self.directory.add_listener(self._on_engine_event)
        self.routing = Routing(routing, self.directory.cache, router_config)
        self._pending_aborts: dict[str, list[PdAbort]] = {}  # engine down -> aborts to send when it is back
        self._receiver = StreamReceiver(spec.data, PdStream, ctx=ctx, name=f"{gateway_name}-streams")
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._current: dict[str, _Attempt] = {}
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._tasks: list[asyncio.Task] = []
        self.num_attempts_lost = 0
        self.vision = vision
        encoders = [EncoderRef(n.name, n.engine) for n in cluster.nodes if n.role is NodeRole.ENCODER and n.engine]
        self.encoders = EncoderPool(encoders, ctx=ctx) if encoders and vision is not None else None

    def metric_collectors(self) -> list:
        """Prometheus collectors the gateway registers on its /metrics (``deepinfer_router_*``)."""
        names = {(e.role.value, e.engine_id): e.name for e in self.directory.engines.values()}
        return [RouterCollector(self.routing, names, lambda: {role.value: len(self.directory.up(role))
                                                             for role in (NodeRole.PREFILL, NodeRole.DECODE)})]

    @property
    def num_in_flight(self) -> int:
        """Requests with an attempt running now."""
        return len(self._current)

    @property
    def stream_address(self) -> str:
        return self._receiver.address

    async def start(self) -> "PdEngineClient":
        await self._receiver.start()
        await self.directory.start()
        if self.encoders is not None:
            await self.encoders.start()
        self._tasks.append(asyncio.create_task(self._pump_streams(), name=f"{self.gateway_name}-streams"))
        return self

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.directory.close()
        if self.encoders is not None:
            await self.encoders.close()
        await self._receiver.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Until at least one prefill and one decode engine are up and reporting load."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        if isinstance(await self.directory.wait_for_candidates(set(), deadline), str):
            raise TimeoutError(f"no prefill + decode engine came up within {timeout_s:g}s")

    # ---- EngineClient ---------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> GatewayTokenizer | None:
        return self._tokenizer

    def stats(self) -> EngineStats:
        loads = self.directory.decode_view.loads()
        return EngineStats(num_running=sum(load.num_requests for load in loads), num_waiting=0)

    async def check_health(self) -> None:
        if not self.directory.up(NodeRole.PREFILL):
            raise RuntimeError("no prefill engine is up")
        if not self.directory.up(NodeRole.DECODE):
            raise RuntimeError("no decode engine is up")

    async def abort(self, request_id: str) -> None:
        attempt = self._current.pop(request_id, None)
        if attempt is None:
            return
        if attempt.lost is not None and not attempt.lost.done():
            attempt.lost.set_result(None)  # None: aborted, not lost
        for entry in (attempt.prefill, attempt.decode):
            asyncio.ensure_future(self._send_abort(entry, request_id, attempt.number, "aborted by the gateway"))

    async def generate(self, prompt: TokensPrompt, params: SamplingParams, *,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        prompt_ids = list(prompt["prompt_token_ids"])
        images = await self._images(prompt, prompt_ids)
        prompt_ids = images.token_ids if images is not None else prompt_ids
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if not params.traffic_class and self.default_traffic_class:  # the class travels with the request
            params = dataclasses.replace(params, traffic_class=self.default_traffic_class)
        sampling = encode_params(params)
        streamed: list[int] = []
        is_prompt_logprobs_sent = False
        excluded: set[str] = set()
        number = 0
        while True:
            attempt = await self._choose(request_id, number, prompt_ids + streamed, excluded, deadline)
            try:
                async for out in self._run_attempt(attempt, prompt_ids, sampling, seed, streamed, deadline, images):
                    out.request_id = request_id
                    if is_prompt_logprobs_sent:
                        out.prompt_logprobs = None
                    is_prompt_logprobs_sent = is_prompt_logprobs_sent or out.prompt_logprobs is not None
                    streamed.extend(out.outputs[0].token_ids)
                    yield out
                    if out.finished:
                        return
                if self._current.get(request_id) is not attempt:
                    return  # aborted
                raise _AttemptLost("the stream ended before the request finished", attempt.decode.name)
            except _AttemptLost as lost:
                self.num_attempts_lost += 1
                self.routing.stats.num_attempts_lost += 1
                excluded.add(lost.engine)
                for entry in (attempt.prefill, attempt.decode):
                    asyncio.ensure_future(self._send_abort(entry, request_id, attempt.number, str(lost)))
                number += 1
                if self.failure_policy == FailurePolicy.FAIL or number >= self.max_attempts or loop.time() >= deadline:
                    why = "failure policy is fail" if self.failure_policy == FailurePolicy.FAIL else \
                        ("deadline reached" if loop.time() >= deadline else f"{number} attempts failed")
                    raise EngineLostError(f"request {request_id}: {lost} ({why})") from None
                log.warning("request %s: %s; recomputing (attempt %d, %d tokens already streamed)",
                            request_id, lost, number, len(streamed))
            finally:
                self._attempts.pop((request_id, attempt.number), None)
                if self._current.get(request_id) is attempt:
                    del self._current[request_id]

    # ---- one attempt ----------------------------------------------------------------------------
    async def _choose(self, request_id: str, number: int, token_ids: list[int], excluded: set[str],
                      deadline: float) -> _Attempt:
        loop = asyncio.get_running_loop()
        candidates = await self.directory.wait_for_candidates(excluded, deadline)
        if isinstance(candidates, str):
            raise EngineLostError(f"request {request_id}: no {candidates} engine is up")
        prefill_loads, decode_loads, now = candidates
        info = self.routing.request_info(request_id, token_ids)
        p, d = self.routing.choose(info, prefill_loads, decode_loads, now)
        self.directory.prefill_view.on_routed(now, p.engine_id, p.predicted_s)
        self.directory.decode_view.on_routed(now, d.engine_id, info.num_prompt_tokens)
        attempt = _Attempt(request_id, number, self.directory.by_id(NodeRole.PREFILL, p.engine_id),
                           self.directory.by_id(NodeRole.DECODE, d.engine_id))
        attempt.lost = loop.create_future()
        self._attempts[(request_id, number)] = attempt
        self._current[request_id] = attempt
        return attempt

    async def _images(self, prompt: TokensPrompt, prompt_ids: list[int]) -> ImagePrompt | None:
        """The prompt's images prepared and its placeholders expanded (None: text only)."""
        if prompt.get("multi_modal_data") is None:
            return None
        if self.encoders is None:
            raise InvalidPromptError("this cluster encodes no images (no vision model or no encoder nodes)")
        return await prepare_prompt_images(self.vision, prompt, prompt_ids)

    async def _encode_images(self, attempt: _Attempt, images: ImagePrompt, deadline: float) -> None:
        """Every image of this attempt encoded into its prefill's inbox (before the dispatch)."""
        erid = engine_request_id(attempt.request_id, attempt.number)
        try:
            done = await self.encoders.encode_until(erid, images.images, attempt.prefill.data_address,
                                                    cut_off=attempt.lost, deadline=deadline)
        except ImageRefused as exc:
            raise InvalidPromptError(str(exc)) from None
        except EncoderUnavailable as exc:
            raise EngineLostError(f"request {attempt.request_id}: {exc}") from None
        if not done and attempt.lost.result() is not None:  # (None: aborted)
            raise _AttemptLost(attempt.lost.result(), attempt.prefill.name)

    async def _run_attempt(self, attempt: _Attempt, prompt_ids: list[int], sampling: bytes, seed: int,
                           streamed: list[int], deadline: float,
                           images: ImagePrompt | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        prefill, decode = attempt.prefill, attempt.decode
        if images is not None:
            await self._encode_images(attempt, images, deadline)
            if attempt.lost.done():
                return  # aborted while encoding
        dispatch = PdDispatch(
            request_id=attempt.request_id, attempt=attempt.number, prompt_token_ids=prompt_ids, sampling=sampling,
            seed=seed, prefill_instance_id=prefill.instance_id, decode=decode.ref(), gateway_name=self.gateway_name,
            gateway_instance_id=self.instance_id, stream_address=self._receiver.address,
            resume_token_ids=list(streamed), deadline_s=max(0.1, deadline - loop.time()),
            images=[PdImage(sp.offset, sp.length, sp.content_hash) for sp in images.spans] if images else [])
        rpc = asyncio.ensure_future(prefill.rpc.request(dispatch, timeout_s=max(0.1, deadline - loop.time())))
        try:
            await asyncio.wait([rpc, attempt.lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not rpc.done():
                rpc.cancel()
        if attempt.lost.done():
            if attempt.lost.result() is None:
                return  # aborted
            raise _AttemptLost(attempt.lost.result(), _lost_engine(attempt.lost.result(), prefill, decode))
        try:
            reply = rpc.result()
        except RemoteError as exc:
            if exc.code == ErrorCode.HANDLER_FAILED and str(exc).startswith(_INPUT_ERRORS):
                kind, _, message = str(exc).partition(": ")
                raise (InvalidPromptError if kind in _PROMPT_ERRORS else ValueError)(message) from None
            raise _AttemptLost(f"prefill {prefill.name}: {exc}", _blamed(str(exc), prefill, decode)) from None
        except TransportError as exc:
            raise _AttemptLost(f"prefill {prefill.name}: {exc}", prefill.name) from None
        if reply.status == HandoffStatus.FINISHED:
            out = decode_output(reply.output)
            tiers = out.metrics.cached_tokens_by_tier if out.metrics is not None else {}
            self.routing.on_prefilled(len(prompt_ids) + len(streamed), out.num_cached_tokens, tiers)
            yield out
            return
        self.routing.on_prefilled(len(prompt_ids) + len(streamed), reply.num_cached_tokens, reply.cached_tokens_by_tier)
        # until the decode's first message: alive engines that lost the request must not hang it
        silence_deadline: float | None = loop.time() + self.decode_silence_s
        while True:
            getter = asyncio.ensure_future(attempt.queue.get())
            wait_until = deadline if silence_deadline is None else min(deadline, silence_deadline)
            try:
                await asyncio.wait([getter, attempt.lost], timeout=max(0.0, wait_until - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                silence_deadline = None
                msg = getter.result()
                if isinstance(msg, PdFailed):
                    raise _AttemptLost(f"decode {decode.name}: {msg.message}", decode.name)
                out = decode_output(msg.output)
                # the decode engine imported the prompt: what was cached is the prefill's to say
                out.num_cached_tokens = max(out.num_cached_tokens, reply.num_cached_tokens)
                yield out
                if out.finished:
                    return
                continue
            if attempt.lost.done():
                if attempt.lost.result() is None:
                    return
                raise _AttemptLost(attempt.lost.result(), decode.name)
            if silence_deadline is not None and loop.time() < deadline:
                raise _AttemptLost(f"decode {decode.name} acknowledged the handoff but sent no output within "
                                   f"{self.decode_silence_s:g}s", decode.name)
            raise EngineLostError(f"request {attempt.request_id}: no output from decode {decode.name} before the "
                                  f"{self.request_timeout_s:g}s request deadline")

    # ---- plumbing -----------------------------------------------------------------------------
    async def _pump_streams(self) -> None:
        async for msg, _ in self._receiver:
            attempt = self._attempts.get((msg.request_id, msg.attempt))
            if attempt is None or msg.engine_instance_id != attempt.decode.instance_id:
                continue  # an abandoned attempt or an old instance: never mixed in
            attempt.queue.put_nowait(msg)

    def _on_engine_event(self, event) -> None:
        if isinstance(event, PeerUp):
            aborts = self._pending_aborts.pop(event.node_name, [])
            entry = self.directory.engines.get(event.node_name)
            if aborts and entry is not None:
                log.info("%s: %s is back; aborting %d attempts it may still run", self.gateway_name,
                         event.node_name, len(aborts))
                for msg in aborts:
                    asyncio.ensure_future(self._send_abort(entry, msg.request_id, msg.attempt, msg.reason))
            return
        if not isinstance(event, PeerDown):
            return
        for attempt in list(self._attempts.values()):
            for entry in (attempt.prefill, attempt.decode):
                if entry.name == event.node_name and attempt.lost is not None and not attempt.lost.done():
                    attempt.lost.set_result(f"{entry.role.value} engine {entry.name} went down "
                                            f"({event.reason.name.lower()})")

    async def _send_abort(self, entry: EngineEntry, request_id: str, number: int, reason: str) -> None:
        if not entry.is_up:  # cut off or restarting: tell it when it is back (a new instance ignores it)
            pending = self._pending_aborts.setdefault(entry.name, [])
            if len(pending) < MAX_PENDING_ABORTS:
                pending.append(PdAbort(request_id, number, reason))
            return
        try:
            await entry.rpc.request(PdAbort(request_id, number, reason), timeout_s=1.0)
        except Exception as exc:
            log.debug("abort of %s@%d not delivered to %s: %s", request_id, number, entry.name, exc)


def _lost_engine(message: str, prefill: EngineEntry, decode: EngineEntry) -> str:
    return prefill.name if f"engine {prefill.name} " in message else decode.name


def _blamed(message: str, prefill: EngineEntry, decode: EngineEntry) -> str:
    """Which engine a prefill's error blames: the decode one when the handoff to it failed."""
    return decode.name if decode.name in message else prefill.name
