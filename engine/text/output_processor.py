"""Turns committed tokens into ``RequestOutput`` deltas: detokenization, stop strings, logprobs.

Token-level stops (EOS, stop ids, max_tokens, min_tokens) are decided by the scheduler
(request.check_token_stop); this module adds what needs text: stop strings, found in the text
produced so far and truncated there (the stop string itself is dropped unless
include_stop_str_in_output). While a request streams with stop strings, the last
``max(len(stop)) - 1`` characters are held back, so a client never sees the beginning of a
stop string that ends up truncated.

Deltas: every ``RequestOutput`` carries only what is new since the previous one (new token ids,
new text, new logprob positions); ``merge_output`` folds deltas into the full result. With
``n > 1`` each completion is its own engine request; their deltas carry the parent id and the
completion index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.engine.api.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sample.sampler import LogprobsTensors


class Detokenizer(Protocol):
    """``step(id) -> new text`` per token; an optional ``flush() -> str`` returns text still held
    back (e.g. an incomplete UTF-8 sequence) and is called once when the request finishes."""

    def step(self, token_id: int) -> str:
        """Append one token; return the text it adds (may be "" while bytes are incomplete)."""


DetokenizerFactory = Callable[[Sequence[int], SamplingParams], Detokenizer]


@dataclass(slots=True)
class _Completion:
    request_id: str  # the parent's id (what the caller asked for)
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    is_prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    max_stop_len: int = 0


@dataclass(slots=True)
class _Parent:
    num_children: int
    num_finished: int = 0


@dataclass(slots=True)
class ProcessedStep:
    output: RequestOutput | None
    num_kept_tokens: int  # < len(new tokens) when a stop string cut them
    stop_string: str | None  # set when a stop string finished the request here


class OutputProcessor:
    def __init__(
        self,
        detokenizer_factory: DetokenizerFactory | None = None,
        decode_token: Callable[[int], str] | None = None,
    ) -> None:
        self.detokenizer_factory = detokenizer_factory
        self.decode_token = decode_token
        self._states: dict[str, _Completion] = {}  # engine request id -> completion state
        self._parents: dict[str, _Parent] = {}

    def add_request(
        self,
        engine_request_id: str,
        parent_id: str,
        index: int,
        num_children: int,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        if params.stop and self.detokenizer_factory is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        detok = self.detokenizer_factory(prompt_token_ids, params) if self.detokenizer_factory else None
        self._states[engine_request_id] = _Completion(
            request_id=parent_id,
            index=index,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            max_stop_len=max((len(x) for x in params.stop), default=0),
        )
        self._parents.setdefault(parent_id, _Parent(num_children))

    def forget(self, engine_request_id: str) -> None:
        """Drop a request added a moment ago without any output (its add was rolled back)."""
        st = self._states.pop(engine_request_id, None)
        if st is not None and not any(other.request_id == st.request_id for other in self._states.values()):
            self._parents.pop(st.request_id, None)

    def has_request(self, engine_request_id: str) -> bool:
        return engine_request_id in self._states

    def add_prompt_logprobs(self, engine_request_id: str, lp: LogprobsTensors, rows: range, num_top: int) -> None:
        st = self._states.get(engine_request_id)
        if st is not None and st.prompt_logprobs is not None:
            st.prompt_logprobs.extend(format_logprobs(lp, rows, num_top, self.decode_token))

    def process(
        self,
        engine_request_id: str,
        new_token_ids: Sequence[int],
        new_logprobs: list[PositionLogprobs] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        now: float,
        num_cached_tokens: int = 0,
    ) -> ProcessedStep:
        st = self._states[engine_request_id]
        num_kept, stop_string = len(new_token_ids), None
        max_stop = st.max_stop_len
        for i, tok in enumerate(new_token_ids):
            st.token_ids.append(tok)
            delta = st.detokenizer.step(tok) if st.detokenizer is not None else ""
            st.text += delta
            if max_stop and delta and len(st.token_ids) >= st.params.min_tokens:
                cut = _find_stop(st.text, len(delta), st.params.stop, st.params.include_stop_str_in_output)
                if cut is not None:
                    st.text, stop_string = cut
                    num_kept = i + 1
                    finish_reason, stop_reason = "stop", stop_string
                    break
        if new_logprobs is not None and st.logprobs is not None:
            for tok, pos in zip(new_token_ids[:num_kept], new_logprobs):
                st.logprobs.append(pos)
                st.cumulative_logprob += pos[tok].logprob
        if st.metrics.first_token_time is None and num_kept:
            st.metrics.first_token_time = now
        st.metrics.num_cached_tokens = num_cached_tokens
        if finish_reason is not None:
            flush = getattr(st.detokenizer, "flush", None)
            if flush is not None and stop_string is None:
                st.text += flush()
            st.finish_reason, st.stop_reason = finish_reason, stop_reason
            st.metrics.finished_time = now
        return ProcessedStep(self._delta(engine_request_id, st, max_stop), num_kept, stop_string)

    def process_one(self, engine_request_id: str, token_id: int, now: float, num_cached_tokens: int = 0) -> RequestOutput:
        """``process`` for the per-step common case, without the generality: one new token that
        finishes nothing, on a request without stop strings or logprobs. Same output."""
        st = self._states[engine_request_id]
        st.token_ids.append(token_id)
        if st.detokenizer is not None:
            st.text += st.detokenizer.step(token_id)
        m = st.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.num_cached_tokens = num_cached_tokens
        new_tokens = st.token_ids[st.num_sent_tokens :]
        text = st.text
        new_text = text[st.num_sent_chars :] if st.num_sent_chars != len(text) else ""
        prompt_lp = None
        if st.prompt_logprobs is not None and not st.is_prompt_logprobs_sent:
            prompt_lp, st.is_prompt_logprobs_sent = st.prompt_logprobs, True
        st.num_sent_tokens, st.num_sent_chars = len(st.token_ids), len(text)
        # not finished, so neither is its parent
        completion = CompletionOutput(st.index, new_text, new_tokens, st.cumulative_logprob)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [completion], False, prompt_lp,
                             num_cached_tokens, m)

    def abort(self, engine_request_id: str, now: float) -> RequestOutput | None:
        st = self._states.get(engine_request_id)
        if st is None:
            return None
        st.finish_reason, st.metrics.finished_time = "abort", now
        return self._delta(engine_request_id, st, 0)

    def _delta(self, engine_request_id: str, st: _Completion, max_stop: int) -> RequestOutput | None:
        finished = st.finish_reason is not None
        # hold back a possible stop-string prefix while streaming
        text_end = len(st.text) if finished or not max_stop else max(st.num_sent_chars, len(st.text) - (max_stop - 1))
        new_tokens = st.token_ids[st.num_sent_tokens :]
        new_text = st.text[st.num_sent_chars : text_end]
        prompt_lp = None
        if st.prompt_logprobs is not None and not st.is_prompt_logprobs_sent and (new_tokens or finished):
            prompt_lp, st.is_prompt_logprobs_sent = st.prompt_logprobs, True
        if not new_tokens and not new_text and not finished and prompt_lp is None:
            return None
        new_lp = None
        if st.logprobs is not None:
            new_lp = st.logprobs[st.num_sent_logprobs :]
            st.num_sent_logprobs = len(st.logprobs)
        st.num_sent_tokens, st.num_sent_chars = len(st.token_ids), text_end
        parent = self._parents[st.request_id]
        if finished:
            del self._states[engine_request_id]
            parent.num_finished += 1
            if parent.num_finished == parent.num_children:
                del self._parents[st.request_id]
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=st.index,
                    text=new_text,
                    token_ids=new_tokens,
                    cumulative_logprob=st.cumulative_logprob,
                    logprobs=new_lp,
                    finish_reason=st.finish_reason,
                    stop_reason=st.stop_reason,
                )
            ],
            finished=parent.num_finished == parent.num_children,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=st.metrics.num_cached_tokens,
            metrics=st.metrics,
        )


def _find_stop(text: str, delta_len: int, stops: Sequence[str], include: bool) -> tuple[str, str] | None:
    """Earliest stop string that ends inside the newest delta; returns (truncated text, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - delta_len - len(s) + 1)
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


def format_logprobs(
    lp: LogprobsTensors, rows: range, num_top: int, decode_token: Callable[[int], str] | None = None
) -> list[PositionLogprobs]:
    """One dict per row: the chosen (or actual prompt) token plus the top ``num_top``."""
    top_ids = lp.top_ids[rows.start : rows.stop, :num_top].tolist()
    top_lps = lp.top_logprobs[rows.start : rows.stop, :num_top].tolist()
    toks = lp.token_ids[rows.start : rows.stop].tolist()
    tok_lps = lp.token_logprobs[rows.start : rows.stop].tolist()
    ranks = lp.token_ranks[rows.start : rows.stop].tolist()
    out: list[PositionLogprobs] = []
    for ids, lps, tok, tok_lp, rank in zip(top_ids, top_lps, toks, tok_lps, ranks):
        pos: PositionLogprobs = {
            t: Logprob(v, j + 1, decode_token(t) if decode_token else None) for j, (t, v) in enumerate(zip(ids, lps))
        }
        if tok not in pos:
            pos[tok] = Logprob(tok_lp, rank, decode_token(tok) if decode_token else None)
        out.append(pos)
    return out


def merge_output(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a delta into the accumulated output (completions matched by index)."""
    if acc is None:
        acc = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], metrics=delta.metrics)
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = CompletionOutput(d.index, "", [], logprobs=[] if d.logprobs is not None else None)
            acc.outputs.append(c)
            acc.outputs.sort(key=lambda x: x.index)
            by_index[d.index] = c
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None and c.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        c.cumulative_logprob = d.cumulative_logprob
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    acc.finished = delta.finished
    acc.num_cached_tokens = max(acc.num_cached_tokens, delta.num_cached_tokens)
    acc.metrics = delta.metrics
    return acc
