"""`deepinfer serve` SWA slot and KV tier flags: they reach EngineOptions, bad ones are one-line
errors, and a served engine saves a finished request's slot and lists it in the SWA directory
its own process hosts (--swa-directory-bind)."""

import asyncio
import re
import signal
import urllib.request

import openai
import pytest

from deepinfer.bin import cli, serve
from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.engine.core.options import EngineOptions
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.protocol import SwaDirectoryReply, SwaLocate
from tests.conftest import free_port, load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")


def test_swa_and_kv_tier_flags_reach_engine_options():
    args = cli.build_parser().parse_args([
        "serve", "--swa-replay", "bounded", "--swa-replay-tokens", "64", "--swa-store-slots", "12",
        "--swa-fetch-deadline", "0.3", "--swa-directory", "tcp://10.0.0.1:7000", "--swa-node-name", "n1",
        "--swa-peer-host", "10.0.0.2", "--kv-host-tier-bytes", "1048576", "--kv-store-dir", "/tmp/kv",
        "--kv-load-deadline", "0.5"])
    options = serve.engine_options(args)
    assert options == dict(swa_replay="bounded", swa_replay_tokens=64, swa_store_slots=12, swa_fetch_deadline_s=0.3,
                           swa_directory="tcp://10.0.0.1:7000", swa_node_name="n1", swa_peer_host="10.0.0.2",
                           kv_host_tier_bytes=1048576, kv_store_dir="/tmp/kv", kv_load_deadline_s=0.5)
    opts = EngineOptions.from_kwargs(**options)
    assert (opts.swa_replay, opts.num_swa_store_slots) == ("bounded", 12)
    # flags not given keep the engine's defaults: exact replay, no slot store (every rebuild exact)
    defaults = EngineOptions.from_kwargs(**serve.engine_options(cli.build_parser().parse_args(["serve"])))
    assert (defaults.swa_replay, defaults.num_swa_store_slots, defaults.swa_directory) == ("exact", 0, None)


@pytest.mark.parametrize("argv, message", [
    (["--swa-replay", "approx"], "argument --swa-replay: invalid choice"),
    (["--swa-replay-tokens", "0"], "--swa-replay-tokens must be >= 1"),
    (["--swa-store-slots", "-1"], "--swa-store-slots must be >= 0"),
    (["--swa-fetch-deadline", "0"], "--swa-fetch-deadline must be between 0 and 3600"),
    (["--kv-host-tier-bytes", "-5"], "--kv-host-tier-bytes must be >= 0"),
    (["--swa-directory-bind", "localhost:1"], "--swa-directory-bind must be tcp://HOST:PORT"),
    (["--swa-directory-bind", "tcp://127.0.0.1:*", "--swa-directory", "tcp://127.0.0.1:9"], "not both"),
    (["--swa-directory", "127.0.0.1:9"], "swa_directory must be tcp://HOST:PORT or ipc://PATH"),
    (["--swa-directory-bind", "tcp://127.0.0.1:*", "--swa-store-slots", "0"], "swa_directory needs a slot store"),
])
def test_bad_swa_flags_one_line_exit_2(tmp_path, capsys, argv, message):
    code, err = proc.serve_usage_error(tmp_path, capsys, argv)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("deepinfer serve: ") and message in err, err


async def _locate(address: str, key: bytes, timeout_s: float = 20.0):
    client = await RequestClient(address, SwaDirectoryReply, name="test-swa-dir").start()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                reply = await client.request(SwaLocate([key]), timeout_s=5)
                if reply.locations[0] is not None:
                    return reply.locations[0]
                await asyncio.sleep(0.1)
    finally:
        await client.close()


@pytest.mark.timeout(180)
def test_served_engine_saves_slots_into_the_directory_it_hosts(port):
    model_dir = harness.tiny_model_dir()
    directory = f"tcp://127.0.0.1:{free_port()}"
    argv = ["--model", str(model_dir), "--max-model-len", "1024", "--served-model-name", "tiny", "--swa-replay",
            "bounded", "--swa-store-slots", "3", "--swa-directory-bind", directory, "--swa-node-name", "served-0"]
    with proc.Served(argv, proc.serve_env(harness.TEST_CACHE_DIR), port) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
        # 130 prompt tokens, blocks of 128: the prefill ends 2 past the boundary, so the state at
        # 128 is snapshotted and saved when the request finishes
        prompt = [(i * 37 + 11) % 4000 + 10 for i in range(130)]
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 3
        client.close()
        hashes = []
        extend_block_hashes(hashes, prompt[:128], 128, root_hash("tiny", ""))
        where = asyncio.run(_locate(directory, hashes[0]))
        assert where.node_name == "served-0" and where.num_tokens == 128
        with urllib.request.urlopen(f"{served.url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert re.search(r"^deepinfer_swa_slots_saved_total [1-9]", metrics, re.M), metrics
        assert re.search(r"^deepinfer_swa_slots_restored_total 0", metrics, re.M), metrics
        code, out, err, _ = served.stop(signal.SIGTERM)
    assert code == 0, err
    assert f"SWA slot directory on {directory}" in out and "Traceback" not in err


def test_disaggregated_rejects_standalone_swa_flags(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code = cli.main(["serve", "--model", str(model), "--disaggregated", "--swa-directory-bind", "tcp://127.0.0.1:*"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--swa-directory-bind is not used with --disaggregated" in err, err


def test_node_takes_the_swa_flags_of_engines():
    from deepinfer.bin import node
    from deepinfer.runtime.cluster_config import NodeRole

    args = cli.build_parser().parse_args(["node", "--role", "prefill", "--cluster", "c.toml", "--swa-replay",
                                          "bounded", "--swa-store-slots", "6", "--swa-directory", "ipc:///tmp/d"])
    kwargs = node._role_kwargs(args, NodeRole.PREFILL)
    assert kwargs["engine_options"] == dict(swa_replay="bounded", swa_store_slots=6, swa_directory="ipc:///tmp/d")
