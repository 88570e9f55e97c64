"""Offline inference with vLLM's shapes: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``.

A deliberately small batch loop over ``ModelRunner``: naive slot and block allocation (every
sequence gets room for ``max_model_len`` tokens), chunked prefill under a token budget, decodes
first, sampling per sequence (engine/llm_sampling.py). It runs prompts to completion and returns
``RequestOutput``s in prompt order. The serving engine (scheduler, prefix cache, async steps,
batched sampler) is engine/engine_core.py; this loop stays isolated so it can be replaced.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.engine.batch import ForwardBatch, SeqStep
from deepinfer.engine.llm_sampling import logprob_entry, process_logits, sample
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.weights import load_checkpoint, resolve_dtype

PromptType = str | Mapping[str, object]


class LLMError(ValueError):
    """A bad argument to LLM or generate; the message names it."""


@dataclass(slots=True)
class _Seq:
    seq_id: int
    request: int  # index into the prompt list
    index: int  # sample index within the request (n > 1)
    params: SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator
    detok: object | None
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


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
        max_num_batched_tokens: int = 2048,
        block_size: int = 128,
        lookahead: int = 6,
        batch_invariant: bool | None = None,
        seed: int = 0,
        num_threads: int | None = None,
    ) -> None:
        model = model or envs.get().hf_model_dir
        if not model:
            raise LLMError("no model: pass LLM(model=DIR) or set DEEPINFER_HF_MODEL_DIR")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise LLMError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
        if num_threads:
            torch.set_num_threads(num_threads)
        from deepinfer.engine.model_config import ModelConfig

        cfg = ModelConfig.from_dir(model)
        # "auto": the checkpoint's dtype on GPUs; float32 on CPU (bf16 GEMMs are slow on most CPUs)
        compute = resolve_dtype("float32" if dtype == "auto" and device == "cpu" else dtype, cfg)
        self.config, state = load_checkpoint(model, dtype=compute, device=device, progress=False)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks_per_seq = -(-self.max_model_len // block_size)
        self.runner = ModelRunner(
            self.config, state, num_blocks=max_num_seqs * self.blocks_per_seq, num_slots=max_num_seqs,
            block_size=block_size, lookahead=lookahead, device=device, dtype=compute, batch_invariant=batch_invariant,
        )  # fmt: skip
        del state
        self.tokenizer = None
        if not skip_tokenizer_init:
            from deepinfer.engine.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(model)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.config.eos_token_id
        self.eos_token_ids = tuple(eos or ())
        self._seed_source = torch.Generator().manual_seed(seed)
        self._next_seq_id = 0

    def get_tokenizer(self):
        return self.tokenizer

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
        arrival = time.time()
        texts, seqs = [], []
        for r, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._prompt_ids(prompt, r)
            self._check(p, ids, r)
            texts.append(text)
            seqs.extend(self._new_seq(r, i, p, ids) for i in range(p.n))
        self._run(seqs)
        return [self._request_output(r, texts[r], [s for s in seqs if s.request == r], arrival) for r in range(len(prompts))]

    # ---- requests -----------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType, r: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LLMError(f"prompt {r} is text but the tokenizer was skipped; pass {{'prompt_token_ids': [...]}}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            return prompt.get("prompt"), ids
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            return self._prompt_ids(prompt["prompt"], r)
        raise LLMError(f"prompt {r} must be a string or a dict with 'prompt_token_ids' or 'prompt'")

    def _check(self, p: SamplingParams, ids: list[int], r: int) -> None:
        vocab = self.config.vocab_size
        if not ids:
            raise LLMError(f"prompt {r} is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise LLMError(f"prompt {r} has token ids outside [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise LLMError(f"prompt {r} has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if p.stop and self.tokenizer is None:
            raise LLMError("stop strings need a tokenizer; use stop_token_ids with skip_tokenizer_init=True")
        if p.structured_outputs is not None:
            raise LLMError("structured_outputs are served by the engine (AsyncEngine), not the offline loop")

    def _new_seq(self, r: int, i: int, p: SamplingParams, ids: list[int]) -> _Seq:
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**31, (1,), generator=self._seed_source))
        gen = torch.Generator().manual_seed((seed * 1_000_003 + i) % 2**63)  # sample i of n: its own stream
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(p.skip_special_tokens, prompt_token_ids=ids)
        self._next_seq_id += 1
        seq = _Seq(self._next_seq_id, r, i, p, list(ids), gen, detok)
        if p.logprobs is not None:
            seq.logprobs = []
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        return seq

    # ---- the loop ---------------------------------------------------------------------
    def _run(self, seqs: list[_Seq]) -> None:
        waiting, running = list(seqs), []
        free_slots = list(range(self.runner.num_slots))
        while waiting or running:
            while waiting and free_slots:
                seq = waiting.pop(0)
                seq.slot = free_slots.pop(0)
                seq.blocks = list(range(seq.slot * self.blocks_per_seq, (seq.slot + 1) * self.blocks_per_seq))
                running.append(seq)
            plan = self._plan(running)
            # one row per sampled token or scored prompt position: sampling runs on the host
            logits = self.runner.execute(ForwardBatch([step for _, step in plan])).cpu()
            row = 0
            for seq, step in plan:
                rows = logits[row : row + step.num_logits]
                row += step.num_logits
                self._commit(seq, step, rows)
            for seq in [s for s in running if s.finish_reason is not None]:
                running.remove(seq)
                free_slots.append(seq.slot)

    def _plan(self, running: list[_Seq]) -> list[tuple[_Seq, SeqStep]]:
        """Decodes first (1 token each), then prefill chunks within the token budget."""
        budget = self.max_num_batched_tokens
        plan = []
        for seq in sorted(running, key=lambda s: s.num_computed < len(s.prompt_ids)):
            left = len(seq.all_ids) - seq.num_computed
            n = min(left, budget)
            if n <= 0:
                continue
            budget -= n
            is_prefill = seq.num_computed < len(seq.prompt_ids)
            reaches_end = seq.num_computed + n == len(seq.all_ids)
            num_logits = int(reaches_end)
            if is_prefill and seq.prompt_logprobs is not None:
                num_logits = n  # every position scores the next prompt token (the last one samples)
            toks = seq.all_ids[seq.num_computed : seq.num_computed + n]
            plan.append((seq, SeqStep(seq.seq_id, seq.slot, seq.blocks, seq.num_computed, toks, num_logits)))
        return plan

    def _commit(self, seq: _Seq, step: SeqStep, rows: torch.Tensor) -> None:
        p = seq.params
        seq.num_computed = step.end_pos
        if seq.prompt_logprobs is not None and step.start_pos < len(seq.prompt_ids):
            for j in range(step.num_logits):
                pos = step.end_pos - step.num_logits + j  # this row predicts position pos + 1
                if pos + 1 < len(seq.prompt_ids):
                    lp = torch.log_softmax(rows[j].float(), -1)
                    seq.prompt_logprobs.append(logprob_entry(lp, seq.prompt_ids[pos + 1], p.prompt_logprobs, self._decode_one))
        if seq.num_computed < len(seq.all_ids) or step.num_logits == 0:
            return  # a middle prefill chunk
        logits = rows[-1]
        banned = [*self.eos_token_ids, *p.stop_token_ids] if len(seq.output_ids) < p.min_tokens else []
        token = sample(process_logits(logits, p, seq.output_ids, seq.prompt_ids, banned), p, seq.generator)
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        if seq.logprobs is not None:
            lp = torch.log_softmax(logits.float(), -1)
            seq.cumulative_logprob += float(lp[token])
            seq.logprobs.append(logprob_entry(lp, token, p.logprobs, self._decode_one))
        seq.output_ids.append(token)
        self._check_stop(seq, token)

    def _check_stop(self, seq: _Seq, token: int) -> None:
        p = seq.params
        if seq.detok is not None:
            seq.text += seq.detok.step(token)
        if len(seq.output_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            else:
                for stop in p.stop:
                    at = seq.text.find(stop)
                    if at >= 0:
                        seq.text = seq.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                        seq.finish_reason, seq.stop_reason = "stop", stop
                        break
        if seq.finish_reason is None:
            limit = p.max_tokens if p.max_tokens is not None else self.max_model_len
            if len(seq.output_ids) >= limit or len(seq.all_ids) >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None and seq.detok is not None and not isinstance(seq.stop_reason, str):
            seq.text += seq.detok.flush()  # a stop string already cut the text

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    def _request_output(self, r: int, text: str | None, seqs: list[_Seq], arrival: float) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.output_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            )  # fmt: skip
            for s in sorted(seqs, key=lambda s: s.index)
        ]
        first = seqs[0]
        metrics = RequestMetrics(arrival_time=arrival, first_token_time=first.first_token_time, finished_time=time.time())
        return RequestOutput(
            request_id=str(r), prompt=text, prompt_token_ids=list(first.prompt_ids), outputs=outputs,
            finished=True, prompt_logprobs=first.prompt_logprobs, metrics=metrics,
        )  # fmt: skip
