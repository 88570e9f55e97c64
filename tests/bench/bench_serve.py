"""`deepinfer bench serve`: load-test a running OpenAI-compatible server.

    deepinfer bench serve --url http://127.0.0.1:8000 --num-prompts 200 --concurrency 32 \\
        --input-len 128 --output-len 64 --prefix-share 0.5 --json serve.json
    deepinfer bench serve --duration 30 --concurrency 200 --num-prompts 400 ...   # closed loop, soak

Streams /v1/completions (``--chat``: /v1/chat/completions) with ``ignore_eos`` so each request
generates exactly ``--output-len`` tokens, and reports TTFT / ITL / e2e percentiles, request
and token throughput and errors. Exit status 1 when no request succeeded.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import urllib.error
import urllib.request

from deepinfer_bench.report import Report, base_parser
from deepinfer_bench.serve_loadgen import LoadConfig, first_errors, run_load, summarize, synthetic_prompts


def _parser():
    p = base_parser("serve", __doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default: all at once)")
    p.add_argument("--input-len", type=int, default=128, help="words per prompt (token ids with --token-ids)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prefix-share", type=float, default=0.0, help="fraction of each prompt shared by all prompts")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    p.add_argument("--token-ids", type=int, default=None, metavar="VOCAB",
                   help="send token-id prompts drawn from [10, VOCAB): exact input lengths (completions only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="closed loop for S seconds: --concurrency clients send request after request "
                        "(cycling through --num-prompts prompts); in-flight requests finish")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _first_model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{url}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    url = args.url.rstrip("/")
    try:
        model = args.model or _first_model(url, args.api_key)
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        print(f"bench serve: cannot list models at {url}/v1/models ({exc}); is the server up? (or pass --model)",
              file=sys.stderr)
        return 1
    try:
        config = LoadConfig(url=url, model=model, num_prompts=args.num_prompts, concurrency=args.concurrency,
                            request_rate=args.request_rate, input_len=args.input_len, output_len=args.output_len,
                            prefix_share=args.prefix_share, use_chat=args.chat, token_id_vocab=args.token_ids,
                            seed=args.seed, api_key=args.api_key, timeout_s=args.timeout,
                            show_progress=not args.no_progress, duration_s=args.duration)
    except ValueError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    prompts = synthetic_prompts(config.num_prompts, config.input_len, config.prefix_share, config.seed,
                                config.token_id_vocab)
    results, duration = asyncio.run(run_load(config, prompts))
    figures = summarize(config, results, duration)

    what = f"{config.duration_s:g} s closed loop" if config.duration_s else f"{config.num_prompts} requests"
    report = Report(f"bench serve: {what} to {url} ({model}, "
                    f"{'chat' if config.use_chat else 'completions'}, concurrency {config.concurrency})")
    for metric in ("ttft", "itl", "e2e"):
        report.row(metric=f"{metric} (ms)", mean=figures[f"{metric}_mean_ms"], p50=figures[f"{metric}_p50_ms"],
                   p90=figures[f"{metric}_p90_ms"], p99=figures[f"{metric}_p99_ms"])
    for name, value in figures.items():
        report.figure(name, value)
    report.finish(args.json)
    for line in first_errors(results):
        print(f"error: {line}", file=sys.stderr)
    return 0 if figures["completed"] else 1
