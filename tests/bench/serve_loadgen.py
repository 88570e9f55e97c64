"""An async load generator for OpenAI-compatible servers (the engine of ``deepinfer bench serve``).

Like ``vllm bench serve``: synthetic prompts from a seed, requests launched at a Poisson rate
(or all at once) under a concurrency cap, every response streamed so time to first token (TTFT),
inter-token latency (ITL: gaps between content chunks) and end-to-end latency are measured on
the client's clock. ``--prefix-share F`` makes the first F of every prompt one shared prefix,
which is what a prefix cache feeds on.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000
    model: str
    num_prompts: int = 100
    concurrency: int = 16
    request_rate: float = math.inf  # requests per second (Poisson arrivals); inf = all at once
    input_len: int = 128  # words per prompt (or token ids with token_id_vocab)
    output_len: int = 64  # max_tokens, with ignore_eos so every request generates exactly this many
    prefix_share: float = 0.0  # fraction of each prompt that is the same for all prompts
    use_chat: bool = False
    token_id_vocab: int | None = None  # send token-id prompts drawn from [10, vocab) (completions only)
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    show_progress: bool = True
    # closed loop for this long: ``concurrency`` clients each send a request, read it to the end,
    # send the next (cycling through the prompts); None = send each prompt once
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.concurrency < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, concurrency, input_len and output_len must all be >= 1")
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError(f"prefix_share must be in [0, 1], got {self.prefix_share}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for no pacing), got {self.request_rate}")
        if self.duration_s is not None and (not self.duration_s > 0 or math.isfinite(self.request_rate)):
            raise ValueError("duration_s must be > 0 and runs a closed loop (no request_rate)")
        if self.token_id_vocab is not None and (self.use_chat or self.token_id_vocab <= 10):
            raise ValueError("token-id prompts need the completions API and a vocabulary larger than 10")


@dataclass(slots=True)
class RequestResult:
    is_ok: bool = False
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


def synthetic_prompts(num: int, length: int, prefix_share: float, seed: int,
                      token_id_vocab: int | None = None) -> list[str | list[int]]:
    """``num`` prompts of ``length`` words (or token ids); the first ``round(prefix_share * length)``
    are the same in all of them."""
    rng = random.Random(seed)
    if token_id_vocab is not None:
        draw = lambda: rng.randrange(10, token_id_vocab)  # noqa: E731
    else:
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(2000)]
        draw = lambda: rng.choice(words)  # noqa: E731
    num_shared = round(prefix_share * length)
    shared = [draw() for _ in range(num_shared)]
    prompts: list[str | list[int]] = []
    for _ in range(num):
        items = shared + [draw() for _ in range(length - num_shared)]
        prompts.append(items if token_id_vocab is not None else " ".join(items))
    return prompts


def _body(config: LoadConfig, prompt: str | list[int]) -> dict:
    common = {"model": config.model, "max_tokens": config.output_len, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if config.use_chat:
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt}


def _content(chunk: dict, use_chat: bool) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if use_chat:
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def _one(session: aiohttp.ClientSession, config: LoadConfig, prompt: str | list[int]) -> RequestResult:
    path = "/v1/chat/completions" if config.use_chat else "/v1/completions"
    res = RequestResult()
    start = last = time.perf_counter()
    num_chunks = 0
    finished_at = None  # when a choice's finish_reason arrived
    try:
        async with session.post(path, json=_body(config, prompt)) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {resp.status}: {text[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.num_prompt_tokens = usage.get("prompt_tokens", 0)
                    res.num_output_tokens = usage.get("completion_tokens", 0)
                    res.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if finished_at is None and any((c or {}).get("finish_reason") for c in chunk.get("choices") or []):
                    finished_at = time.perf_counter()
                if _content(chunk, config.use_chat):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
        res.e2e_s = time.perf_counter() - start
        res.num_output_tokens = res.num_output_tokens or num_chunks
        if res.ttft_s is None and finished_at is not None and res.num_output_tokens:
            # a finished completion whose tokens all decode to no text (special tokens, a held-back
            # partial character): a success, its first output seen with the finish
            res.ttft_s = finished_at - start
        res.is_ok = res.ttft_s is not None
        if not res.is_ok:
            res.error = "the stream carried no content"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(config: LoadConfig, prompts: list[str | list[int]]) -> tuple[list[RequestResult], float]:
    """Send every prompt (or, with ``duration_s``, keep ``concurrency`` clients busy that long);
    returns the per-request results and the wall time of the whole run."""
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.concurrency)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    gate = asyncio.Semaphore(config.concurrency)
    rng = random.Random(config.seed + 1)
    bar = tqdm(total=None if config.duration_s else len(prompts), disable=not config.show_progress,
               desc="requests", unit="req")
    if config.duration_s is not None:
        async with aiohttp.ClientSession(config.url, connector=connector, timeout=timeout, headers=headers) as session:
            results, duration = await _closed_loop(session, config, prompts, bar)
        bar.close()
        return results, duration

    async def limited(prompt):
        async with gate:
            result = await _one(session, config, prompt)
        bar.update(1)
        return result

    async with aiohttp.ClientSession(config.url, connector=connector, timeout=timeout, headers=headers) as session:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def _closed_loop(session: aiohttp.ClientSession, config: LoadConfig, prompts: list[str | list[int]],
                       bar) -> tuple[list[RequestResult], float]:
    """``concurrency`` clients, each one request at a time, starting new ones until the deadline
    (requests in flight then run to their end and count)."""
    start = time.perf_counter()
    deadline = start + config.duration_s

    async def client(k: int) -> list[RequestResult]:
        done = []
        i = k
        while time.perf_counter() < deadline:
            done.append(await _one(session, config, prompts[i % len(prompts)]))
            i += config.concurrency
            bar.update(1)
        return done

    per_client = await asyncio.gather(*(client(k) for k in range(config.concurrency)))
    return [r for rs in per_client for r in rs], time.perf_counter() - start


def _stats_ms(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_{k}_ms": None for k in ("mean", "p50", "p90", "p99")}
    arr = np.asarray(values) * 1000.0
    return {f"{name}_mean_ms": float(arr.mean()), f"{name}_p50_ms": float(np.percentile(arr, 50)),
            f"{name}_p90_ms": float(np.percentile(arr, 90)), f"{name}_p99_ms": float(np.percentile(arr, 99))}


def summarize(config: LoadConfig, results: list[RequestResult], duration_s: float) -> dict[str, float | int | None]:
    ok = [r for r in results if r.is_ok]
    num_in = sum(r.num_prompt_tokens for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    figures: dict[str, float | int | None] = {
        "num_prompts": len(results),
        "concurrency": config.concurrency,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "output_tokens_per_s": num_out / duration_s if duration_s > 0 else 0.0,
        "total_tokens_per_s": (num_in + num_out) / duration_s if duration_s > 0 else 0.0,
        "cached_prompt_fraction": sum(r.num_cached_tokens for r in ok) / num_in if num_in else 0.0,
    }
    figures.update(_stats_ms("ttft", [r.ttft_s for r in ok]))
    figures.update(_stats_ms("itl", [x for r in ok for x in r.itl_s]))
    figures.update(_stats_ms("e2e", [r.e2e_s for r in ok]))
    return figures


def first_errors(results: list[RequestResult], limit: int = 3) -> list[str]:
    """The distinct error messages, most common first."""
    counts: dict[str, int] = {}
    for r in results:
        if r.error:
            counts[r.error] = counts.get(r.error, 0) + 1
    return [f"{n} x {e}" for e, n in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]
