"""FakeEngine: a fake of the *engine* for unit tests of the HTTP gateway. Not a model.

It implements the gateway's ``EngineClient`` protocol with deterministic token streams so the
HTTP layer can be tested without weights: tokens are printable-ASCII vocabulary ids drawn from
``random.Random(f"{seed}:{prompt}")`` (temperature 0 ignores the seed), one delta per step with
a small sleep. It honours ``max_tokens``, ``min_tokens``, ``ignore_eos``, stop strings (held
back while streaming, like the real output processor), ``stop_token_ids``, ``logprobs``, abort
(recorded in ``aborted``), a bounded waiting queue (``EngineOverloadedError``), and emulates a
prefix cache over 16-token blocks so ``num_cached_tokens`` is non-zero on repeated prompts.
Invalid regex / JSON schema / EBNF is rejected by the real xgrammar backend with the engine's
typed ``StructuredOutputError`` (the fake does not constrain its output).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer.engine.api.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.api.protocol import (
    EngineOverloadedError,
    EngineStats,
    InvalidPromptError,
    ModelInfo,
    TokensPrompt,
)
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sample.structured_output import StructuredOutputBackend
from deepinfer.engine.text.tokenizer import Tokenizer

BLOCK_SIZE = 16
EOS_PROBABILITY = 1 / 48


@dataclass(slots=True)
class RecordedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Live:
    is_running: bool = False
    is_aborted: bool = False


@dataclass
class FakeEngine:
    tok: Tokenizer
    name: str = "fake-tiny"
    max_model_len: int = 512
    step_delay_s: float = 0.002
    prefill_delay_s: float = 0.001
    max_running: int = 64
    max_waiting: int | None = None
    tokens_per_step: int = 1
    requests: list[RecordedRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    is_healthy: bool = True

    def __post_init__(self) -> None:
        vocab = self.tok.vocab_size
        self._info = ModelInfo(self.name, self.max_model_len, vocab, tuple(self.tok.eos_token_ids), created=1_700_000_000)
        specials = set(self.tok.all_special_ids)
        self.word_ids = [i for i in range(vocab) if i not in specials and _is_plain(self.tok.decode([i]))]
        self._backend = StructuredOutputBackend([self.tok.id_to_token(i) for i in range(vocab)],
                                                self.tok.eos_token_ids, vocab_type="byte_level")
        self._slots = asyncio.Semaphore(self.max_running)
        self._live: dict[str, _Live] = {}
        self._blocks: set[int] = set()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- EngineClient ---------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tok

    def stats(self) -> EngineStats:
        running = sum(1 for s in self._live.values() if s.is_running)
        rate = self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
        return EngineStats(running, len(self._live) - running, self.max_waiting, rate)

    async def check_health(self) -> None:
        if not self.is_healthy:
            raise RuntimeError("the fake engine was told to be unhealthy")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        live = self._live.get(request_id)
        if live is not None:
            live.is_aborted = True

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def generate(self, prompt: TokensPrompt, params: SamplingParams, *, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        ids = list(prompt["prompt_token_ids"])
        if params.n != 1:
            raise ValueError(f"n must be 1 here (the gateway fans out), got {params.n}")
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        bad = next((t for t in ids if not 0 <= t < self._info.vocab_size), None)
        if bad is not None:
            raise InvalidPromptError(f"prompt token id {bad} is outside the vocabulary")
        if params.structured_outputs is not None:
            await asyncio.to_thread(self._backend.compile, params.structured_outputs)
        stats = self.stats()
        if self.max_waiting is not None and stats.num_waiting >= self.max_waiting:
            raise EngineOverloadedError(f"queue full ({stats.num_waiting} waiting)")
        self.requests.append(RecordedRequest(request_id, ids, params))
        live = self._live[request_id] = _Live()
        try:
            async with self._slots:
                live.is_running = True
                async for out in self._run(request_id, ids, params, live):
                    yield out
        finally:
            del self._live[request_id]

    # ---- the fake decode loop ---------------------------------------------------------------
    async def _run(self, request_id: str, ids: list[int], params: SamplingParams, live: _Live
                   ) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep(self.prefill_delay_s)
        num_cached = self._lookup_prefix(ids)
        key = 0 if params.is_greedy else (params.seed if params.seed is not None else random.getrandbits(63))
        rng = random.Random(f"{key}:{ids}")
        eos = self._info.eos_token_ids[0] if self._info.eos_token_ids else None
        hold = max((len(s) for s in params.stop), default=0)
        tokens: list[int] = []
        text, num_sent_chars = "", 0
        while True:
            if live.is_aborted:
                yield self._output(request_id, ids, [], "", None, "abort", None, num_cached)
                return
            new_ids, new_lps, finish, stop_reason = [], [], None, None
            for _ in range(self.tokens_per_step):
                tid = self._next_token(rng, params, len(tokens), eos)
                tokens.append(tid)
                new_ids.append(tid)
                if params.logprobs is not None:
                    new_lps.append(self._logprobs(rng, tid, params))
                if tid == eos:
                    finish = "stop"
                    break
                if tid in params.stop_token_ids:
                    finish, stop_reason = "stop", tid
                    break
                text += self.tok.decode([tid])
                hit = _find_stop(text, params.stop) if len(tokens) >= params.min_tokens else None
                if hit is not None:
                    cut, stop = hit
                    text = text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
                    finish, stop_reason = "stop", stop
                    break
                if len(tokens) >= params.max_tokens:
                    finish = "length"
                    break
            end = len(text) if finish or not hold else max(num_sent_chars, len(text) - (hold - 1))
            delta, num_sent_chars = text[num_sent_chars:end], end
            yield self._output(request_id, ids, new_ids, delta, new_lps if params.logprobs is not None else None,
                               finish, stop_reason, num_cached)
            if finish:
                return
            await asyncio.sleep(self.step_delay_s)

    def _next_token(self, rng: random.Random, params: SamplingParams, position: int, eos: int | None) -> int:
        may_stop = not params.ignore_eos and position >= params.min_tokens and eos is not None
        if may_stop and rng.random() < EOS_PROBABILITY:
            return eos
        return rng.choice(self.word_ids)

    def _logprobs(self, rng: random.Random, chosen: int, params: SamplingParams) -> dict[int, Logprob]:
        """Made-up but well-formed: ``k`` ranked alternatives plus the chosen token."""
        k = params.logprobs
        others = [t for t in rng.sample(self.word_ids, k + 1) if t != chosen][:k]
        chosen_rank = 1 if params.is_greedy else rng.randint(1, k + 2)
        ranked = others[: chosen_rank - 1] + [chosen] + others[chosen_rank - 1:]
        out = {}
        for rank, tid in enumerate(ranked, start=1):
            if rank <= k or tid == chosen:
                out[tid] = Logprob(-0.25 * rank - 0.01 * (tid % 7), rank, self.tok.decode([tid]))
        return out

    def _lookup_prefix(self, ids: list[int]) -> int:
        """Cached tokens: the longest run of full blocks seen before (hash chain), then remember these."""
        num_hit, is_hit, h = 0, True, 0
        for b in range(len(ids) // BLOCK_SIZE):
            h = hash((h, tuple(ids[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE])))
            if is_hit and h in self._blocks:
                num_hit += BLOCK_SIZE
            else:
                is_hit = False
                self._blocks.add(h)
        num_hit = min(num_hit, len(ids) - 1)  # the last prompt token is always computed
        self.num_queried_tokens += len(ids)
        self.num_hit_tokens += num_hit
        return num_hit

    @staticmethod
    def _output(request_id, ids, new_ids, text, logprobs, finish, stop_reason, num_cached) -> RequestOutput:
        out = CompletionOutput(0, text, new_ids, None, logprobs, finish, stop_reason)
        return RequestOutput(request_id, None, ids, [out], finished=finish is not None, num_cached_tokens=num_cached)


def _is_plain(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable()


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
