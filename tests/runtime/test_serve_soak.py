"""Soak: 200 concurrent streaming clients against a real `deepinfer serve` (tiny model, CPU).

Each client sends a streaming completion, reads it to [DONE], sends the next, for
``DEEPINFER_SOAK_SECONDS`` (default 8 s, so `make test` stays fast; the issue's figure is 30 s:
``DEEPINFER_SOAK_SECONDS=30 .venv/bin/python -m pytest -q tests/runtime/test_serve_soak.py``).
Afterwards: zero errors, the engine holds no request (running == waiting == 0, no KV block in
use, nothing in flight in the gateway, all read from /metrics), and the server's RSS over the
last third of the run is within a bound of the first third (no leak proportional to requests).
"""

import asyncio
import importlib
import os
import re
import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import load_bench_module, load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")
load_bench_module("serve")
loadgen = importlib.import_module("deepinfer_bench.serve_loadgen")

SOAK_SECONDS = float(os.environ.get("DEEPINFER_SOAK_SECONDS", "8"))
NUM_CLIENTS = 200
# RSS may grow this much between the first and the last third (allocator and tokenizer caches
# settle), but not by anything like the per-request state of thousands of requests
MAX_RSS_GROWTH_BYTES = 48 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler(threading.Thread):
    """(seconds since start, RSS bytes) of ``pid`` every ``period_s`` until stopped."""

    def __init__(self, pid: int, period_s: float = 0.25):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []
        self._is_stopping = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._is_stopping.is_set():
            self.samples.append((time.monotonic() - self._t0, rss_bytes(self.pid)))
            self._is_stopping.wait(self.period_s)

    def stop(self) -> None:
        self._is_stopping.set()
        self.join(timeout=5)

    def window_mean(self, start_s: float, end_s: float) -> float:
        values = [rss for t, rss in self.samples if start_s <= t < end_s]
        assert values, f"no RSS samples between {start_s} and {end_s} s"
        return statistics.fmean(values)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS) + 240)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_200_streaming_clients_soak_no_errors_no_leaks_stable_memory(port):
    model_dir = harness.tiny_model_dir()
    args = ["--model", str(model_dir), "--max-num-seqs", "64", "--max-model-len", "512"]
    with proc.Served(args, proc.serve_env(harness.TEST_CACHE_DIR), port) as served:
        config = loadgen.LoadConfig(url=served.url, model=model_dir.name, num_prompts=NUM_CLIENTS * 2,
                                    concurrency=NUM_CLIENTS, input_len=8, output_len=8, prefix_share=0.5,
                                    show_progress=False, duration_s=SOAK_SECONDS, timeout_s=SOAK_SECONDS + 120)
        prompts = loadgen.synthetic_prompts(config.num_prompts, config.input_len, config.prefix_share, seed=5)
        sampler = RssSampler(served.proc.pid)
        sampler.start()
        try:
            results, duration = asyncio.run(loadgen.run_load(config, prompts))
        finally:
            sampler.stop()
        figures = loadgen.summarize(config, results, duration)
        assert figures["errors"] == 0, loadgen.first_errors(results)
        assert figures["completed"] >= NUM_CLIENTS  # every client finished at least one request
        assert figures["output_tokens"] == figures["completed"] * config.output_len
        # nothing leaked: the engine and the gateway are idle, every KV block is free or evictable
        assert metric(served.url, "deepinfer_num_requests_running") == 0
        assert metric(served.url, "deepinfer_num_requests_waiting") == 0
        assert metric(served.url, "deepinfer_gateway_requests_in_flight") == 0
        assert metric(served.url, "deepinfer_kv_cache_usage") == 0.0
        finished = metric(served.url, 'deepinfer_requests_finished_total{finish_reason="length"}')
        assert finished == figures["completed"]
        third = min(10.0, duration / 3)
        first = sampler.window_mean(0.0, third)
        last = sampler.window_mean(duration - third, duration)
        growth = last - first
        print(f"\nsoak {duration:.1f} s, {NUM_CLIENTS} clients: {figures['completed']} requests, "
              f"{figures['output_tokens_per_s']:.0f} output tok/s, ttft p50 {figures['ttft_p50_ms']:.0f} ms, "
              f"itl p50 {figures['itl_p50_ms']:.0f} ms; server RSS first {third:.0f} s {first / 2**20:.1f} MiB, "
              f"last {third:.0f} s {last / 2**20:.1f} MiB (growth {growth / 2**20:+.1f} MiB)")
        assert growth < MAX_RSS_GROWTH_BYTES, (first, last)
        code, _, err, _ = served.stop(signal.SIGTERM)
        assert code == 0, err
