"""One HTTP request's engine requests: start them, merge their deltas, abort what is left.

A request with ``p`` prompts and ``n`` choices becomes ``p * n`` engine requests (choice
``index = prompt * n + i``, seed ``seed + i``). They are submitted together (one pump task
each, feeding one inbox), so their prefills overlap. ``start()`` returns once every engine
request has produced its first output -- that is where the engine reports bad input (invalid
grammar, full queue), before any HTTP header has gone out. ``close()`` aborts every engine
request that has not finished (client gone, handler cancelled, error) and is always called.

Folding a delta into its choice also times it into the gateway's histograms (metrics.py
defines them): time to first token, inter-token latency, end-to-end latency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.api.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.engine.api.protocol import EngineClient, TokensPrompt
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.runtime.gateway.errors import GatewayError, from_engine_error
from deepinfer.runtime.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

_END = object()


@dataclass(slots=True)
class EngineRequest:
    index: int  # choice index in the response
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    multi_modal_data: Mapping[str, Any] | None = None  # a chat's images (chat_images.py), prompt already expanded


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far (the sum of its deltas)."""

    index: int
    prompt_index: int
    num_prompt_tokens: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # asked for: they come with the first output
    last_token_time: float | None = None
    is_started: bool = False  # the engine accepted it (a first output arrived)
    is_done: bool = False  # the engine stream ended

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class EngineFailure(GatewayError):
    """The engine failed or aborted a request on its own while it was being served."""

    def __init__(self, message: str):
        super().__init__(message, status=503, code="engine_error")


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        requests: list[EngineRequest],
        metrics: GatewayMetrics,
        *,
        arrival_time: float,
        structured_param: str | None = None,
        prompt_param: str | None = None,
    ):
        self.engine = engine
        self.requests = requests
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.structured_param = structured_param
        self.prompt_param = prompt_param  # the request field of the prompt ("prompt", "messages")
        self.choices = [ChoiceState(r.index, r.prompt_index, len(r.prompt_token_ids)) for r in requests]
        self._inbox: deque[tuple[int, object]] = deque()  # (slot, RequestOutput | exception | _END)
        self._has_mail = asyncio.Event()
        self._pumps: list[asyncio.Task] = []
        self._buffered: deque[tuple[int, object]] = deque()  # mail start() took before deltas() runs
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Submit every engine request; wait for each one's first output (or its error)."""
        for slot, r in enumerate(self.requests):
            prompt: TokensPrompt = {"prompt_token_ids": r.prompt_token_ids}
            if r.multi_modal_data:
                prompt["multi_modal_data"] = r.multi_modal_data
            stream = self.engine.generate(prompt, r.params, request_id=r.request_id)
            self._pumps.append(asyncio.create_task(self._pump(slot, stream), name=f"gateway-pump-{r.request_id}"))
        pending = set(range(len(self.requests)))
        while pending:
            slot, item = await self._next()
            if slot not in pending:
                # a choice that already started can finish (and its stream end) before the others
                # start, e.g. a one-token request: keep its mail in order for deltas()
                self._buffered.append((slot, item))
                continue
            if isinstance(item, BaseException):
                raise self._map_error(item)
            if item is _END:
                self.choices[slot].is_done = True
                raise self._failure(slot, "ended request {id} without an output")
            pending.discard(slot)
            self.choices[slot].is_started = True
            self._buffered.append((slot, item))

    async def deltas(self) -> AsyncIterator[tuple[ChoiceState, CompletionOutput]]:
        """Each engine delta, after it was folded into its choice's state; ends when all are done."""
        while self._buffered or not all(c.is_done for c in self.choices):
            slot, item = self._buffered.popleft() if self._buffered else await self._next()
            delta = self._receive(slot, item)
            if delta is not None:
                yield self.choices[slot], delta

    @property
    def has_ready(self) -> bool:
        """The next delta is already here, so a caller may hold its writes to send them together."""
        if self._buffered:
            return True
        for _, item in self._inbox:  # stream ends are consumed without a wait; an error stops the scan
            if isinstance(item, RequestOutput):
                return True
            if item is not _END:
                return False
        return False

    async def close(self) -> None:
        """Abort every unfinished engine request and stop the pumps (idempotent, survives cancel)."""
        if self._closed:
            return
        self._closed = True
        if all(t.done() for t in self._pumps) and all(c.finish_reason is not None for c in self.choices):
            return  # nothing to abort: return without an await, so a client hanging up now cancels nothing
        task = asyncio.ensure_future(self._cleanup())
        await asyncio.shield(task)

    async def _cleanup(self) -> None:
        # aborting an id the engine never accepted is a no-op by contract; only started ones count
        for r, c in zip(self.requests, self.choices):
            if c.finish_reason is not None:
                continue
            try:
                await self.engine.abort(r.request_id)
            except Exception:
                log.exception("engine.abort(%s) failed", r.request_id)
            if c.is_started:
                self.metrics.requests_finished.labels("abort").inc()
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    # ---- internals ------------------------------------------------------------------------
    async def _pump(self, slot: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._post(slot, out)
                if out.finished:
                    break
        except Exception as exc:  # CancelledError (close) is not caught: it ends the task
            self._post(slot, exc)
            return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    log.exception("closing the engine stream of %s failed", self.requests[slot].request_id)
        self._post(slot, _END)

    def _post(self, slot: int, item: object) -> None:
        self._inbox.append((slot, item))
        self._has_mail.set()

    async def _next(self) -> tuple[int, object]:
        while not self._inbox:
            self._has_mail.clear()
            await self._has_mail.wait()
        return self._inbox.popleft()

    def _map_error(self, exc: BaseException) -> GatewayError:
        if isinstance(exc, GatewayError):
            return exc
        mapped = from_engine_error(exc, self.structured_param, self.prompt_param) if isinstance(exc, Exception) else None
        if mapped is not None:
            return mapped
        log.error("engine error", exc_info=exc)
        return EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}".splitlines()[0])

    def _failure(self, slot: int, what: str) -> EngineFailure:
        """The engine ended request ``slot`` on its own; ``what`` fills "the engine ... request
        <id> ...". Logged, since the client only sees a 503 (and SDKs retry those)."""
        message = "the engine " + what.replace("{id}", self.requests[slot].request_id)
        log.error("%s", message)
        return EngineFailure(message)

    def _receive(self, slot: int, item: object) -> CompletionOutput | None:
        """Handle one piece of mail of a started choice: a delta, its stream's end or an error."""
        choice = self.choices[slot]
        if item is _END:
            choice.is_done = True
            if choice.finish_reason is None:
                raise self._failure(slot, "ended request {id} before it finished")
            return None
        if isinstance(item, BaseException):
            choice.is_done = True
            mapped = self._map_error(item)
            raise mapped if isinstance(mapped, EngineFailure) else EngineFailure(mapped.message)
        return self._apply(slot, item)

    def _apply(self, slot: int, out: RequestOutput) -> CompletionOutput | None:
        choice = self.choices[slot]
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if not out.outputs:
            return None
        delta = out.outputs[0]
        now = time.monotonic()
        num_new = len(delta.token_ids)
        if num_new:
            self._time_tokens(choice, now, num_new)
        choice.num_tokens += num_new
        choice.token_ids.extend(delta.token_ids)
        if delta.text:
            choice.text_parts.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        if delta.finish_reason is not None and choice.finish_reason is None:
            if delta.finish_reason == "abort":
                raise self._failure(slot, "aborted request {id}")
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            m = self.metrics
            m.requests_finished.labels(delta.finish_reason).inc()
            m.e2e.observe(now - self.arrival_time)
            m.prompt_tokens.inc(choice.num_prompt_tokens)
            m.cached_prompt_tokens.inc(out.num_cached_tokens)
            spec = out.metrics.spec_counts if out.metrics is not None else None
            if spec is not None:
                for stage, count in zip(("drafted", "verified", "accepted"), spec):
                    m.spec_request.labels(stage).observe(count)
        return delta

    def _time_tokens(self, choice: ChoiceState, now: float, num_new: int) -> None:
        """A choice's first delta is its time to first token (from the HTTP request's arrival);
        every token after it gets one inter-token sample, the gap since the choice's previous
        delta spread over the tokens the delta carries (the rest of a multi-token first delta
        arrived with it: no gap)."""
        m = self.metrics
        m.generation_tokens.inc(num_new)
        if choice.last_token_time is None:
            m.ttft.observe(now - self.arrival_time)
            num_gaps, gap = num_new - 1, 0.0
        else:
            num_gaps, gap = num_new, now - choice.last_token_time
        for _ in range(num_gaps):
            m.itl.observe(gap / num_gaps)
        choice.last_token_time = now

    # ---- totals ---------------------------------------------------------------------------
    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens); a prompt counts once however
        many choices it has."""
        prompt: dict[int, int] = {}
        cached: dict[int, int] = {}
        for c in self.choices:
            prompt[c.prompt_index] = c.num_prompt_tokens
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        return sum(prompt.values()), sum(c.num_tokens for c in self.choices), sum(cached.values())
