"""`deepinfer serve --kv-store-nodes`: the flags reach EngineOptions, bad values are one-line errors
naming the flag, and a served engine writes a prompt's KV blocks into real storage daemons so a
second server process (empty device pool, no host tier) answers the same completion with those
tokens cached from the cluster and the same text."""

from __future__ import annotations

import signal

import openai
import pytest

from deepinfer.bin import cli, serve
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.engine.core.options import EngineOptions
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")


def test_kv_store_cluster_flags_reach_engine_options():
    args = cli.build_parser().parse_args(["serve", "--kv-store-nodes", "tcp://10.0.0.1:7200,tcp://10.0.0.2:7200",
                                          "--kv-store-ec", "1+1", "--kv-load-deadline", "0.5"])
    options = serve.engine_options(args)
    assert options == dict(kv_store_nodes="tcp://10.0.0.1:7200,tcp://10.0.0.2:7200", kv_store_ec="1+1",
                           kv_load_deadline_s=0.5)
    opts = EngineOptions.from_kwargs(**options)
    assert (opts.kv_store_nodes, opts.kv_store_ec) == (options["kv_store_nodes"], "1+1")


@pytest.mark.parametrize("argv, message", [
    (["--kv-store-nodes", "tcp://127.0.0.1:1", "--kv-store-dir", "/tmp/kv"], "--kv-store-dir (a filesystem store) or "
                                                                             "--kv-store-nodes"),
    (["--kv-store-ec", "2+1"], "--kv-store-ec needs --kv-store-nodes"),
    (["--kv-store-nodes", "tcp://127.0.0.1:1,tcp://127.0.0.1:2"], "--kv-store-nodes lists 2 storage nodes; erasure "
                                                                  "coding 10+2 needs at least 12"),
    (["--kv-store-nodes", "tcp://127.0.0.1:1", "--kv-store-ec", "1"], "--kv-store-ec must be K+M"),
    (["--kv-store-nodes", "10.0.0.1:7200"], "--kv-store-nodes: '10.0.0.1:7200' is neither storage node addresses"),
    (["--kv-store-nodes", "tcp://127.0.0.1:1", "--disaggregated"], "--kv-store-nodes is not used with --disaggregated"),
])
def test_bad_kv_store_cluster_flags_one_line_exit_2(tmp_path, capsys, argv, message):
    code, err = proc.serve_usage_error(tmp_path, capsys, argv)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("deepinfer serve: ") and message in err, err


@pytest.mark.timeout(180)
def test_second_server_answers_from_the_cluster_store(tmp_path, port):
    model_dir = harness.tiny_model_dir()
    prompt = [(i * 53 + 7) % 4000 + 10 for i in range(300)]  # (300 - 1) // 128 = 2 full blocks can hit
    with LocalCluster(tmp_path / "kv", 6) as cluster:
        argv = ["--model", str(model_dir), "--max-model-len", "1024", "--served-model-name", "tiny",
                "--kv-store-nodes", ",".join(cluster.addresses.values()), "--kv-store-ec", "4+2",
                "--kv-load-deadline", "5", "--num-threads", "1"]
        answers = []
        for _ in range(2):  # a fresh process each time: its device pool starts empty
            with proc.Served(argv, proc.serve_env(harness.TEST_CACHE_DIR), port) as served:
                client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
                resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0,
                                                 extra_body={"ignore_eos": True})
                client.close()
                # SIGTERM: the engine finishes its write-behind to the cluster before exiting
                code, out, err, _ = served.stop(signal.SIGTERM)
                assert code == 0 and "Traceback" not in err, err
                answers.append(resp)
    first, second = answers
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 300
    assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 256  # both blocks, from the store
    assert second.choices[0].text == first.choices[0].text and first.usage.completion_tokens == 4
