"""Offline inference with vLLM's shapes: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``.

A thin synchronous wrapper over ``AsyncEngine``: the engine lives on its own event loop in a
background thread (started once, so the model loads once), and ``generate`` queues every prompt
(in order, all validated before any output is awaited), waits for all of them and returns one
merged ``RequestOutput`` per prompt, in prompt order. Works from plain synchronous code and
from a thread whose own loop is running (it never touches the caller's loop).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.api.async_engine import AsyncEngine, RequestStream
from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.options import EngineOptionsError
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.engine.text.tokenizer import Tokenizer

PromptType = str | Mapping[str, object]


class LLMError(ValueError):
    """A bad argument to LLM or generate; the message names it."""


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 32768,
        block_size: int = 128,
        lookahead: int = 6,
        batch_invariant: bool | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        **engine_options: Any,
    ) -> None:
        """``engine_options``: any other ``EngineOptions`` field (num_blocks, enable_prefix_caching, ...)."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        options = dict(dtype=dtype, device=device, skip_tokenizer_init=skip_tokenizer_init, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, lookahead=lookahead, batch_invariant=batch_invariant, seed=seed,
                       num_threads=num_threads, **engine_options)  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deepinfer-llm-loop", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, None)
        try:
            self.engine: AsyncEngine = self._call(AsyncEngine.start(model, **options))
        except EngineOptionsError as e:
            self._finalizer()
            raise LLMError(str(e)) from None
        except BaseException:
            self._finalizer()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, self.engine)
        self.config = self.engine.model_config
        self.max_model_len = self.engine.model_info.max_model_len
        self._request_ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.core.config.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        """Applies to requests queued afterwards."""
        core = self.engine.core
        core.config = replace(core.config, eos_token_ids=tuple(ids))

    def shutdown(self) -> None:
        """Stop the engine and its thread (also done when the LLM is garbage collected)."""
        self._finalizer()

    # ---- public API -------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise LLMError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if not self._finalizer.alive:
            raise LLMError("this LLM was shut down")
        return self._call(self._generate(prompts, params))

    async def _generate(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[RequestOutput]:
        streams: list[RequestStream] = []
        try:
            for r, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    streams.append(await self.engine.submit(prompt, p, request_id=str(next(self._request_ids))))
                except ValueError as e:
                    raise LLMError(f"prompt {r}: {e}") from None
            return list(await asyncio.gather(*(_collect(s) for s in streams)))
        finally:
            for s in streams:
                s.close()  # no-op for finished ones; aborts the rest after an error

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


async def _collect(stream: RequestStream) -> RequestOutput:
    acc = None
    async for out in stream:
        acc = merge_output(acc, out)
    return acc


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine: AsyncEngine | None) -> None:
    if engine is not None and not loop.is_closed():
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
