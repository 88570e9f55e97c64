"""`deepinfer bench serve` against a FakeEngine gateway: figures are right, errors are counted."""

import importlib
import json

import pytest

from deepinfer.runtime.gateway.config import STATE_KEY
from tests.conftest import load_bench_module, load_test_helper

harness = load_test_helper("runtime/gateway_harness")
bench = load_bench_module("serve")
loadgen = importlib.import_module("deepinfer_bench.serve_loadgen")


@pytest.fixture(scope="module")
def server():
    with harness.ThreadedGateway(lambda: harness.fake_engine(max_model_len=1024, step_delay_s=0.001)) as gw:
        yield gw


def test_synthetic_prompts_share_the_prefix():
    prompts = loadgen.synthetic_prompts(5, 40, 0.5, seed=3)
    words = [p.split() for p in prompts]
    assert all(len(w) == 40 for w in words)
    assert all(w[:20] == words[0][:20] for w in words)
    assert len({tuple(w[20:]) for w in words}) == 5
    assert prompts == loadgen.synthetic_prompts(5, 40, 0.5, seed=3)
    ids = loadgen.synthetic_prompts(3, 16, 0.25, seed=1, token_id_vocab=100)
    assert all(len(p) == 16 and all(10 <= t < 100 for t in p) for p in ids)
    assert ids[0][:4] == ids[1][:4] == ids[2][:4]


@pytest.mark.parametrize("chat", [False, True])
def test_bench_serve_reports_latencies_and_throughput(server, tmp_path, chat, capsys):
    out = tmp_path / "serve.json"
    argv = ["--url", server.url, "--num-prompts", "24", "--concurrency", "8", "--input-len", "64",
            "--output-len", "6", "--prefix-share", "0.5", "--json", str(out), "--no-progress"]
    assert bench.main(argv + (["--chat"] if chat else [])) == 0
    fig = json.loads(out.read_text())
    assert (fig["completed"], fig["errors"]) == (24, 0)
    assert fig["output_tokens"] == 24 * 6  # ignore_eos: exactly --output-len each
    assert fig["input_tokens"] >= 24 * 64
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"):
        assert fig[key] > 0, key
    assert fig["ttft_p99_ms"] >= fig["ttft_p50_ms"] and fig["itl_p99_ms"] >= fig["itl_p50_ms"]
    assert fig["e2e_p50_ms"] >= fig["ttft_p50_ms"]
    assert fig["output_tokens_per_s"] > 0 and fig["request_throughput"] > 0
    assert fig["cached_prompt_fraction"] > 0.2  # half of every prompt is one shared prefix
    assert "ttft (ms)" in capsys.readouterr().out
    assert server.call(lambda: server.engine.num_live) == 0


def test_bench_serve_paced_token_id_prompts(server, tmp_path):
    out = tmp_path / "paced.json"
    argv = ["--url", server.url, "--num-prompts", "10", "--concurrency", "4", "--request-rate", "200",
            "--token-ids", "1000", "--input-len", "32", "--output-len", "3", "--json", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    fig = json.loads(out.read_text())
    assert fig["errors"] == 0 and fig["input_tokens"] == 10 * 32 and fig["request_rate"] == 200


def test_bench_serve_closed_loop_for_a_duration(server, tmp_path):
    out = tmp_path / "closed.json"
    argv = ["--url", server.url, "--num-prompts", "3", "--concurrency", "4", "--duration", "1.0", "--input-len", "8",
            "--output-len", "3", "--json", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    fig = json.loads(out.read_text())
    assert fig["errors"] == 0
    assert fig["completed"] == fig["num_prompts"] > 4  # each client sent several requests (prompts cycle)
    assert fig["output_tokens"] == fig["completed"] * 3
    assert 1.0 <= fig["duration_s"] < 10.0
    assert server.call(lambda: server.engine.num_live) == 0


def test_bench_serve_counts_errors(server, tmp_path, capsys):
    out = tmp_path / "bad.json"
    argv = ["--url", server.url, "--model", "no-such-model", "--num-prompts", "5", "--concurrency", "2",
            "--json", str(out), "--no-progress"]
    assert bench.main(argv) == 1
    fig = json.loads(out.read_text())
    assert (fig["completed"], fig["errors"]) == (0, 5)
    assert "HTTP 404" in capsys.readouterr().err


def test_bench_serve_without_a_server_says_so(capsys):
    assert bench.main(["--url", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert "is the server up" in capsys.readouterr().err


# (requests, prompt words, tokens each): the real engine on 2 CPU cores prefills ~500 and
# decodes ~100-200 tokens/s, so its share is smaller
LOAD_BY_ENGINE = {"fake": (400, 24, 12), "tiny": (200, 8, 6)}


@pytest.mark.parametrize("engine_kind", sorted(harness.ENGINE_FACTORIES))
async def test_200_concurrent_streaming_clients_no_errors_no_leaks(engine_kind):
    num_prompts, input_len, output_len = LOAD_BY_ENGINE.get(engine_kind, (200, 8, 6))
    async with harness.ENGINE_FACTORIES[engine_kind]() as engine:
        async with harness.running_gateway(engine) as gateway:
            config = loadgen.LoadConfig(url=gateway.url, model=engine.model_info.name, num_prompts=num_prompts,
                                        concurrency=200, input_len=input_len, output_len=output_len, prefix_share=0.3,
                                        show_progress=False)
            prompts = loadgen.synthetic_prompts(config.num_prompts, config.input_len, config.prefix_share, 0)
            results, duration = await loadgen.run_load(config, prompts)
            figures = loadgen.summarize(config, results, duration)
            assert figures["errors"] == 0, loadgen.first_errors(results)
            assert figures["output_tokens"] == num_prompts * output_len
            stats = engine.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            state = gateway.app[STATE_KEY]
            assert state.num_in_flight == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("finished", [True, False])
async def test_a_finished_stream_without_text_is_a_completion(finished):
    """Tokens that decode to no text (special tokens, a held-back partial character) still make a
    finished completion: counted with its usage, not as an error; a stream that ends with neither
    text nor a finish is an error."""
    import aiohttp
    from aiohttp import web

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        if finished:
            chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
        for c in chunks:
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        config = loadgen.LoadConfig(url=f"http://127.0.0.1:{port}", model="m", use_chat=True, output_len=2)
        async with aiohttp.ClientSession(base_url=config.url) as session:
            res = await loadgen._one(session, config, "hello")
    finally:
        await runner.cleanup()
    assert res.is_ok is finished and res.num_output_tokens == 2
    assert (res.error is None) is finished
