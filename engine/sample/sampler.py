"""Sampling from the runner's logits: vectorised over rows, deterministic, batch-invariant. The
device thread's half of a step's sampling (``Sampler.sample_step``: tensor work only on what
metadata.py prepared: sample, verify drafts, prompt logprobs).

Order per row (each step is row-wise, so no row sees another):
  raw logprobs (returned to the user, vLLM's default "raw" mode)
  -> structured-output bitmask, min_tokens suppression
  -> repetition / frequency / presence penalties
  -> greedy rows: argmax
  -> other rows: temperature, min-p, top-k, top-p, then Gumbel-max with counter-based noise
     hash(seed, position, token): argmax(logits/T + G) draws exactly from softmax(logits/T).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.sample.metadata import PenaltyTensors, SamplingMetadata, SamplingPrep
from deepinfer.kernels import gpu_sampling
from deepinfer.kernels.counter_rng import GumbelNoise

_NEG_INF = float("-inf")
# rows per block of noisy_argmax: one float32 block of this many elements stays in L2
_ARGMAX_BLOCK_ELEMENTS = 1 << 16


@dataclass(slots=True)
class LogprobsTensors:
    """Top-k logprobs plus the chosen token's, for ``B`` rows (all on CPU)."""

    top_ids: torch.Tensor  # [B, K] int64, most likely first
    top_logprobs: torch.Tensor  # [B, K] float32
    token_ids: torch.Tensor  # [B] the sampled (or, for prompts, the actual next) token
    token_logprobs: torch.Tensor  # [B]
    token_ranks: torch.Tensor  # [B] int64, 1 = most likely


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64 on CPU
    logprobs: LogprobsTensors | None


@dataclass(slots=True)
class SampledStep:
    """One step's sampled tokens. The device thread stores only what the next step's forward
    needs; on a plain step (one row per request) that is the row tokens in order
    (``plain_tokens``, rows of ``plain_ids``), and the per-request maps ``last_tokens`` and
    ``accepted`` are built when first read, normally by the caller's thread while the next
    forward runs: the device thread's time between forwards cannot be hidden."""

    sampler_output: SamplerOutput | None = None
    request_rows: dict[str, range] = field(default_factory=dict)  # rows of sampler_output per request
    prompt_logprobs: LogprobsTensors | None = None
    prompt_rows: dict[str, range] = field(default_factory=dict)
    plain_ids: list[str] | None = None  # plain step: the request of each row (SamplingPrep.plain_ids)
    # plain step: the row tokens as a tensor where they were sampled (on an accelerator the next
    # forward can take them from there, ForwardBatch.token_source, before the host has them)
    device_tokens: torch.Tensor | None = None
    _plain_tokens: list[int] | None = None
    _host_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None  # (pinned copy, its event) until read
    _last_tokens: dict[str, int] | None = None  # None on a plain step until asked for
    _accepted: dict[str, list[int]] | None = None

    @property
    def plain_tokens(self) -> list[int] | None:
        """Plain step: the token sampled in each row. On an accelerator the first read waits for
        the copy queued right after sampling (only this step's work, not a forward queued behind
        it); two threads may both resolve it, to the same list."""
        if self._plain_tokens is None and self._host_copy is not None:
            host, copied = self._host_copy
            copied.synchronize()
            self._plain_tokens = host.tolist()
            self._host_copy = None
        return self._plain_tokens

    @plain_tokens.setter
    def plain_tokens(self, tokens: list[int] | None) -> None:
        self._plain_tokens, self._host_copy = tokens, None

    @property
    def last_tokens(self) -> dict[str, int]:
        """request id -> last accepted token (what a placeholder of the next step stands for)."""
        if self._last_tokens is None:
            self._last_tokens = dict(zip(self.plain_ids or (), self.plain_tokens or ()))
        return self._last_tokens

    @property
    def accepted(self) -> dict[str, list[int]]:
        """request id -> accepted tokens (1 + accepted drafts)."""
        if self._accepted is None:
            self._accepted = {rid: [tok] for rid, tok in zip(self.plain_ids or (), self.plain_tokens or ())}
        return self._accepted


class Sampler:
    def __init__(self) -> None:
        self.noise = GumbelNoise()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"sampler got logits of shape {tuple(logits.shape)} for {meta.num_rows} rows")
        if meta.is_plain_greedy:
            # the common serving case: one reduction, no masks, no copies
            return SamplerOutput(argmax_rows(logits), None)
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.bitmask is not None or meta.suppress is not None or meta.penalties is not None:
            logits = logits.clone()  # masked in place below; the caller's logits stay intact
        if meta.bitmask is not None:
            apply_token_bitmask(logits, meta.bitmask)
        if meta.suppress is not None:
            logits[meta.suppress] = _NEG_INF
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)

        if meta.all_greedy:
            sampled = argmax_rows(logits)
        elif meta.is_all_sampled:  # no gather, no scatter
            sampled = self._sample_random(logits, meta, None)
        else:
            rows = torch.nonzero(~meta.is_greedy).squeeze(1)
            sampled = argmax_rows(logits)
            sampled[rows] = self._sample_random(logits[rows], meta, rows)

        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled.cpu(), lp)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor | None) -> torch.Tensor:
        """Tokens of the sampled rows ``rows`` (None: every row; ``logits`` holds just those)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or rows is None else t[rows]

        temperature, keys, top_k = pick(meta.temperature), pick(meta.keys), pick(meta.top_k)
        if meta.min_p is None and meta.top_p is None and (top_k is None or not bool((top_k < logits.shape[1]).any())):
            # temperature only (the common sampled case): one fused pass, noise usually drawn ahead
            noise = meta.noise
            if noise is None and gpu_sampling.available(logits):  # one fused kernel, same tokens
                return gpu_sampling.gumbel_argmax(logits, temperature, keys,
                                                  self.noise.token_hash32(logits.shape[1], logits.device))
            if noise is None or tuple(noise.shape) != tuple(logits.shape):
                noise = self.noise.gumbel(keys, logits.shape[1])
            return noisy_argmax(logits, temperature, noise)
        if rows is None:
            rows = torch.arange(meta.num_rows, device=logits.device)
        logits = logits / temperature.unsqueeze(1)  # from here on this function's own tensors
        if meta.min_p is not None:
            # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p): no softmax needed
            cutoff = logits.max(dim=-1, keepdim=True).values + torch.log(meta.min_p[rows]).unsqueeze(1)
            logits = logits.masked_fill(logits < cutoff, _NEG_INF)
        top_p = meta.top_p[rows] if meta.top_p is not None else None
        out = torch.empty(rows.numel(), dtype=torch.int64, device=logits.device)
        has_k = meta.top_k[rows] < logits.shape[1] if meta.top_k is not None else None
        if has_k is not None and bool(has_k.any()):
            # Rows with a top-k: sample among their candidates only (noise gathered per token
            # id, so the draw equals the full-vocabulary path's).
            ik = torch.nonzero(has_k).squeeze(1)
            top_k = meta.top_k[rows][ik]
            cand, cand_ids = logits[ik].topk(int(top_k.max()), dim=-1)
            ranks = torch.arange(cand.shape[1], device=cand.device).unsqueeze(0)
            cand = cand.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
            if top_p is not None:
                cand = _mask_top_p_sorted(cand, top_p[ik])
            g = self.noise.gumbel(keys[ik], logits.shape[1], cand_ids)
            out[ik] = cand_ids.gather(1, argmax_rows(cand + g).unsqueeze(1)).squeeze(1)
            rest = torch.nonzero(~has_k).squeeze(1)
        else:
            rest = torch.arange(rows.numel(), device=logits.device)
        if rest.numel():
            sub = logits[rest]
            if top_p is not None:
                sub = apply_top_k_top_p(sub, None, top_p[rest])
            noise = meta.noise
            if noise is None and gpu_sampling.available(sub):  # sub is already divided: T = 1
                out[rest] = gpu_sampling.gumbel_argmax(sub, torch.ones(rest.numel(), device=sub.device), keys[rest],
                                                       self.noise.token_hash32(sub.shape[1], sub.device))
                return out
            if noise is None or tuple(noise.shape) != tuple(sub.shape):
                noise = self.noise.gumbel(keys[rest], sub.shape[1])
            out[rest] = argmax_rows(sub.add_(noise))  # (same bits as sub + noise)
        return out

    def sample_step(self, prep: SamplingPrep, logits: torch.Tensor) -> SampledStep:
        """One step's sampling, tensor work only (the device thread): sample, verify drafts, logprobs."""
        out = SampledStep(request_rows=prep.request_rows, prompt_rows=prep.prompt_rows)
        if prep.meta is not None:
            sel = logits if prep.row_index is None else logits.index_select(0, prep.row_index)
            out.sampler_output = self(sel, prep.meta)
            ids = out.sampler_output.token_ids
            if prep.plain_ids is not None:  # maps built on demand
                out.plain_ids, out.device_tokens = prep.plain_ids, ids
                if ids.device.type == "cuda":  # the host read is deferred: plain_tokens
                    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                    host.copy_(ids, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()
                    out._host_copy = (host, copied)
                else:
                    out.plain_tokens = ids.tolist()
            else:
                sampled = ids.tolist()
                out._accepted = {rid: verify_drafts(sampled[r.start : r.stop], prep.drafts[rid])
                                 for rid, r in prep.request_rows.items()}
                out._last_tokens = {rid: toks[-1] for rid, toks in out._accepted.items()}
        elif prep.plain_ids is not None:
            out.plain_ids, out.plain_tokens = prep.plain_ids, []
        if prep.prompt_index is not None:
            lp = logits.index_select(0, prep.prompt_index).float().log_softmax(dim=-1)
            out.prompt_logprobs = gather_logprobs(lp, prep.prompt_targets, prep.max_prompt_top)
        return out

    def precompute_noise(self, meta: SamplingMetadata, vocab_size: int) -> None:
        """Draw the full-vocabulary Gumbel noise of ``meta``'s rows now (``meta.noise``): it
        depends only on (seed, position, token), so the caller's thread can make it while the
        forward runs instead of the device thread after it. Same rows, order and values as the
        sampler would draw. CPU only: on an accelerator the draw is a few cheap kernels, and
        launching them from the caller's thread would interleave with the forward's stream."""
        if meta.all_greedy or meta.num_rows == 0 or meta.keys.device.type != "cpu":
            return
        rows = torch.nonzero(~meta.is_greedy).squeeze(1)
        if meta.top_k is not None:
            rows = rows[meta.top_k[rows] >= vocab_size]  # top-k rows draw at their candidates only
        if rows.numel():
            meta.noise = self.noise.gumbel(meta.keys[rows], vocab_size)


def verify_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """Accept drafts while each equals the token the sampler draws at its position, then the
    first differing (or bonus) token. With counter-based sampling the result is exactly what
    non-speculative decoding produces: drafts change speed, never outputs."""
    accepted = []
    for k, tok in enumerate(sampled):
        accepted.append(tok)
        if k >= len(drafts) or tok != drafts[k]:
            break
    return accepted


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (first maximum; NaN counts as the maximum, as in torch). On CPU float32
    numpy's SIMD argmax is ~6x faster than torch's at [256, 4096] and, holding the GIL, costs
    the engine's device thread no GIL hand-off."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] > 0 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def noisy_argmax(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(logits / temperature[:, None] + noise, dim=-1)`` (the Gumbel-max draw). On CPU
    float32 it runs over blocks of rows that stay in the L2 cache: the same IEEE divide and add
    (numpy and torch round alike), one pass over memory instead of three."""
    if not (logits.device.type == "cpu" and logits.dtype == noise.dtype == temperature.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and not logits.requires_grad):
        return argmax_rows((logits / temperature.unsqueeze(1)).add_(noise))
    x, t, g = logits.numpy(), temperature.numpy()[:, None], noise.numpy()
    num_rows = x.shape[0]
    rows = max(1, _ARGMAX_BLOCK_ELEMENTS // x.shape[1])
    buf = np.empty((min(rows, num_rows), x.shape[1]), dtype=np.float32)
    out = np.empty(num_rows, dtype=np.intp)
    for r0 in range(0, num_rows, rows):
        r1 = min(r0 + rows, num_rows)
        b = buf[: r1 - r0]
        np.divide(x[r0:r1], t[r0:r1], out=b)
        b += g[r0:r1]
        np.argmax(b, axis=-1, out=out[r0:r1])
    return torch.from_numpy(out.astype(np.int64, copy=False))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: token v of row i stays only if bit (v % 32) of ``bitmask[i, v // 32]`` is set
    (xgrammar's layout). Works on any device; no per-row Python."""
    b, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(b, -1)[:, :v]
    logits.masked_fill_(~allowed.to(logits.device), _NEG_INF)


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """vLLM semantics: repetition divides positive / multiplies negative logits of tokens seen
    in prompt or output; frequency subtracts count * f; presence subtracts p once."""
    rep = torch.where(logits > 0, 1.0 / pen.repetition, pen.repetition)
    logits.mul_(torch.where(pen.seen_mask, rep, torch.ones_like(rep)))
    logits.sub_(pen.frequency * pen.output_counts)
    logits.sub_(pen.presence * (pen.output_counts > 0).float())


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        sorted_logits = _mask_top_p_sorted(sorted_logits, top_p)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


def _mask_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """On descending-sorted logits: drop tokens whose preceding mass already exceeds top_p."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), _NEG_INF)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Top-``num_top`` entries, the given tokens' logprobs and their ranks, from ``[B, V]`` logprobs."""
    token_ids = token_ids.to(logprobs.device)
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > token_lp).sum(dim=-1) + 1
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_lp = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsTensors(top_ids.cpu(), top_lp.cpu(), token_ids.cpu(), token_lp.squeeze(1).cpu(), ranks.cpu())
