"""``AsyncEngine``: the engine inside any running asyncio loop (vLLM's AsyncLLM shape).

    engine = await AsyncEngine.start(model=DIR, dtype="float32", max_num_seqs=16)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        out.outputs[0].text          # the new text of this delta
    await engine.abort("r1"); await engine.shutdown()

One background task runs the engine's pipelined ``StepLoop`` (engine/core/step_loop.py): forwards
run on one device thread while the loop schedules the next step and commits the previous one,
and between those awaits the loop serves everything else (HTTP, new requests, aborts). Every
EngineCore call happens on the loop's thread, so no locks. The step loop's ``deliver`` hook
pushes each request's deltas into its ``RequestStream``; ``generate`` yields them (coalesced
when the consumer lags).

SWA slots: with ``swa_directory`` set, ``start`` also starts a ``SwaPeer`` sharing the slot store;
``submit`` first prefetches the slot of a new request's prefix hit while steps go on (a miss or a
dead owner within ``swa_fetch_deadline_s`` leaves it to replay).

Failures: bad input raises a one-line ValueError (``InvalidPromptError``, ``SamplingParamsError``,
``StructuredOutputError``) from ``generate``'s first ``__anext__``, checked by the component that
owns the fact (EngineCore, the scheduler, SamplingParams); this class checks only that it accepts
requests at all (alive, open). A step that raises fails every running request (``EngineStepError``)
and drops the prefix cache (a failed step's blocks may hold garbage), and the engine serves on;
after ``max_consecutive_failures`` failed steps in a row it is dead: ``check_health`` raises and
new requests are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.cache.swa_peer import SwaPeer
from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.protocol import (
    EngineDeadError,
    EngineStats,
    EngineStepError,
    InvalidPromptError,
    ModelInfo,
    one_line,
)
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.factory import EngineParts, build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.core.step_loop import FailurePolicy, FailureScope, StepHooks, StepLoop, tune_interpreter
from deepinfer.engine.kv.swa_slots import SwaSlotManager, SwaSlotRunner
from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.mm.prompt import encode_prompt_images
from deepinfer.engine.models.registry import FamilyConfig
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any]


class RequestStream:
    """One queued request's deltas (``AsyncEngine.submit``): the step loop's ``deliver`` hook puts
    them in, the caller iterates them (deltas that piled up meanwhile come merged into one);
    ``close()`` aborts the request unless it has finished."""

    __slots__ = ("request_id", "items", "ready", "is_done", "_release", "_is_closed")

    def __init__(self, request_id: str, release: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.items: deque[RequestOutput | BaseException] = deque()
        self.ready = asyncio.Event()
        self.is_done = False  # the last delta (or an error) is in
        self._release = release  # the engine forgets the stream (and aborts the request if unfinished)
        self._is_closed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` unless it has ended."""
        if not self.is_done:
            self.is_done = True
            self.put(error)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_closed:
            raise StopAsyncIteration
        try:
            while not self.items:
                self.ready.clear()
                await self.ready.wait()
            out = self.items.popleft()
            if isinstance(out, BaseException):
                raise out
            # coalesce deltas that piled up while the consumer was busy (an error stays queued)
            while self.items and not out.finished and isinstance(self.items[0], RequestOutput):
                out = merge_output(merge_output(None, out), self.items.popleft())
        except BaseException:
            self.close()
            raise
        if out.finished:
            self.close()
        return out

    def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._release(self)


class AsyncEngine:
    """Implements the ``EngineClient`` protocol (engine/api/protocol.py)."""

    def __init__(self, parts: EngineParts, options: EngineOptions, *, max_consecutive_failures: int = 3) -> None:
        """Use ``await AsyncEngine.start(...)``; this wires already-built parts to the running loop."""
        self.options = options
        self.core: EngineCore = parts.core
        self._parts = parts
        self._loop = asyncio.get_running_loop()
        self._device = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-device")
        self._compile = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-grammar")
        self._streams: dict[str, RequestStream] = {}
        self._is_closed = False  # no new requests; the step loop ends once idle
        self._shutdown_task: asyncio.Task | None = None
        self._dead_reason: str | None = None
        self._max_failures = max_consecutive_failures
        self.swa_slots: SwaSlotManager | None = parts.swa_slots
        self.swa_peer: SwaPeer | None = None
        self._model_info = ModelInfo(
            name=parts.served_model_name,
            max_model_len=min(parts.max_model_len, self.core.config.num_blocks * options.block_size),
            vocab_size=parts.model_config.vocab_size,
            eos_token_ids=self.core.config.eos_token_ids,
            created=parts.created,
        )
        self._steps = StepLoop(self.core, self._device, StepHooks(deliver=self._deliver, fail=self._fail_requests),
                               name="deepinfer-engine", is_pipelined=True,
                               failure=FailurePolicy(FailureScope.RUNNING, evict_prefix_cache=True),
                               check_integrity=options.check_integrity_every_step)
        tune_interpreter(options.switch_interval_s)
        self._task = self._loop.create_task(self._run_steps(), name="deepinfer-step-loop")

    @classmethod
    async def start(cls, model: str | Path | None = None, **options: Any) -> AsyncEngine:
        """Load ``model`` (a checkpoint directory) off the loop and start serving.
        ``options``: the fields of ``EngineOptions`` (dtype, device, max_num_seqs, ...)."""
        model = model or envs.get().hf_model_dir
        if not model:
            raise ValueError("no model: pass AsyncEngine.start(model=DIR) or set DEEPINFER_HF_MODEL_DIR")
        opts = EngineOptions.from_kwargs(**options)
        parts = await asyncio.get_running_loop().run_in_executor(None, build_engine, model, opts)
        engine = cls(parts, opts)
        if opts.swa_directory is not None:
            try:
                await engine.start_swa_peer(opts.swa_directory, node_name=opts.swa_node_name, host=opts.swa_peer_host)
            except BaseException:
                await engine.shutdown()
                raise
        return engine

    async def start_swa_peer(self, directory_address: str, *, node_name: str | None = None,
                             instance_id: int | None = None, host: str = "127.0.0.1", publisher=None) -> SwaPeer:
        """Share this engine's SWA slot store through the directory at ``directory_address``
        (serve its slots, fetch others' before queueing requests); closed by ``shutdown``."""
        if self.swa_slots is None or self.swa_slots.store is None or not isinstance(self.core.runner, SwaSlotRunner):
            raise ValueError("this engine has no SWA slot store to share (swa_store_slots=0)")
        if self.swa_peer is not None:
            raise ValueError("this engine already has an SWA peer")
        peer = SwaPeer(self.swa_slots.store, directory_address=directory_address, node_name=node_name,
                       instance_id=instance_id, host=host, publisher=publisher)
        await peer.start()
        self.swa_peer = peer
        self.swa_slots.fetcher = peer.fetcher
        return peer

    # ---- EngineClient -------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._parts.tokenizer

    @property
    def model_config(self) -> FamilyConfig:
        return self._parts.model_config

    @property
    def vision(self) -> VisionEncoder | None:
        """The model's image preprocessing (and tower, unless load_vision=False); None: text only."""
        return self._parts.vision

    @property
    def num_failed_steps(self) -> int:
        return self._steps.num_failed_steps

    def stats(self) -> EngineStats:
        sched, pool = self.core.scheduler, self.core.scheduler.pool  # pool: the device block pool
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            max_num_waiting=self.options.max_num_waiting,
            prefix_cache_hit_rate=pool.num_hits / pool.num_queries if pool.num_queries else None,
            kv_cache_usage=pool.usage,
            swa_slots=dataclasses.asdict(self.swa_slots.stats) if self.swa_slots is not None else None,
            spec=self.core.spec.stats.as_dict() if self.core.spec is not None else None,
            ep=ep_stats() if (ep_stats := getattr(self.core.runner, "ep_stats", None)) is not None else None,
        )

    def metric_collectors(self) -> list:
        """Collectors for the /metrics of the process serving this engine: the KV tier and store
        client counters (``deepinfer_kv_*``, ``deepinfer_store_client_*``) when it has KV tiers."""
        from deepinfer.engine.kv.tier_metrics import KVTierCollector

        offload = self._parts.kv_offload
        return [KVTierCollector(offload, self._parts.served_model_name)] if offload is not None else []

    async def check_health(self) -> None:
        self._check_accepting()

    async def generate(
        self, prompt: PromptType, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput`` deltas; the last has ``finished=True``. Bad input raises a
        one-line ValueError here before anything is queued; leaving the loop early aborts."""
        outputs = await self.submit(prompt, params, request_id=request_id)
        try:
            async for out in outputs:
                yield out
        finally:
            outputs.close()

    async def submit(
        self, prompt: PromptType, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestStream:
        """``generate`` in two stages: validate and queue now (raising for bad input), stream
        later. Iterate the result to the end or ``close()`` it (that aborts the request)."""
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        return await self._add_request(rid, prompt, params or SamplingParams())

    async def abort(self, request_id: str) -> None:
        """Finish ``request_id`` with "abort" and free its blocks and slot at once (the step in
        flight drops its result); an unknown or finished id is a no-op."""
        self._deliver(self.core.abort([request_id]))

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the step loop and join the device thread (idempotent)."""
        if self._shutdown_task is None:
            self._shutdown_task = self._loop.create_task(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        self._is_closed = True
        self._deliver(self.core.abort(list(self._streams)))
        for stream in self._streams.values():  # streams whose request never reached the core
            stream.fail(EngineDeadError("the engine is shut down"))
        self._steps.close()
        try:
            await self._task
        finally:
            if self.swa_peer is not None:
                self.swa_slots.fetcher = None
                await self.swa_peer.close()
            # joined from a thread of its own, not an executor: at interpreter exit (an LLM left
            # to the garbage collector) executors refuse new work, and joining must not block the loop
            await _run_in_new_thread(self._shutdown_threads, name="deepinfer-shutdown")

    def _shutdown_threads(self) -> None:
        self._device.shutdown(wait=True)
        self._compile.shutdown(wait=True)
        offload = self._parts.kv_offload
        if offload is not None:  # built with the engine: finish its write-behind, stop its threads
            offload.run_pending_device_io()  # the last commit's copy-outs (the device thread is gone)
            offload.wait_for_writes(5.0)
            offload.close()

    # ---- requests -----------------------------------------------------------------------
    async def _add_request(self, rid: str, prompt: PromptType, params: SamplingParams) -> RequestStream:
        self._check_accepting()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        mm_inputs = ()
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:  # images (engine/mm)
            ids, mm_inputs = await encode_prompt_images(self._parts.vision, prompt, ids, self._device)
            self._check_accepting()
        grammar = None
        if params.structured_outputs is not None:
            # compiled (and cached) on a worker thread: a big schema never stalls the loop
            grammar = await self._loop.run_in_executor(self._compile, self.core.compile_grammar,
                                                       params.structured_outputs)
            self._check_accepting()
        swa = self.swa_slots
        if swa is not None and swa.fetcher is not None and self.core.scheduler.config.enable_prefix_caching:
            # the slot at the hit this request will get, from the engine that holds it (bounded
            # by swa_fetch_deadline_s; never raises for a remote failure: a miss replays)
            await swa.prefetch_for(self.core.scheduler.kv, ids)
            self._check_accepting()
        self.core.add_request(rid, ids, params, prompt=text, grammar=grammar, mm_inputs=mm_inputs)
        stream = RequestStream(rid, self._release)
        self._streams[rid] = stream
        self._steps.wake()
        return stream

    def _check_accepting(self) -> None:
        """Alive and open (checked again after every await: the engine may die meanwhile)."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._is_closed:
            raise EngineDeadError("the engine is shut down")

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self._parts.tokenizer
            if tok is None:
                raise InvalidPromptError("the prompt is text but the tokenizer was skipped; pass {'prompt_token_ids': [...]}")
            return prompt, tok.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str) or not isinstance(ids, Sequence) or any(type(t) is not int for t in ids):
                    raise InvalidPromptError("prompt_token_ids must be a list of integers")
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, list(ids)
            if isinstance(prompt.get("prompt"), str):
                return self._prompt_ids(prompt["prompt"])
        raise InvalidPromptError("a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'")

    def _release(self, stream: RequestStream) -> None:
        rid = stream.request_id
        if self._streams.get(rid) is stream:
            del self._streams[rid]
            if not stream.is_done:  # the caller left early (cancelled, closed, error)
                self.core.abort([rid])

    # ---- step loop hooks ------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and not stream.is_done:
                stream.is_done = out.finished
                stream.put(out)

    def _fail_requests(self, request_ids: list[str], error: Exception) -> None:
        message = f"the model step failed ({type(error).__name__}: {one_line(error)})"
        for rid in {self.core.parent_id(rid) for rid in request_ids}:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.fail(EngineStepError(message))
        if self._steps.num_failures_in_row >= self._max_failures:
            self._die(f"the engine stopped after {self._steps.num_failures_in_row} failed steps in a row: {message}")

    async def _run_steps(self) -> None:
        try:
            await self._steps.run()
        except BaseException as e:  # a crashed loop must fail the streams, never strand them
            self._die(f"the engine's step loop stopped ({type(e).__name__}: {one_line(e)})")
            if not isinstance(e, Exception):
                raise
            log.exception("engine step loop crashed")

    def _die(self, reason: str) -> None:
        """No more requests: fail every open stream with ``reason``; check_health raises it."""
        if self._dead_reason is None:
            self._dead_reason = reason
        self._is_closed = True
        self._steps.close()
        try:
            self.core.abort(list(self._streams))
        except Exception:  # noqa: BLE001 - the core may be what broke; the streams still end
            log.exception("abort after an engine failure")
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError(self._dead_reason))


async def _run_in_new_thread(fn: Callable[[], object], *, name: str) -> None:
    """Run ``fn`` on a fresh thread and await it (works while the interpreter is exiting)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    await asyncio.wrap_future(done)
