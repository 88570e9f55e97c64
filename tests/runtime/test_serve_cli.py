"""`deepinfer serve` as a user runs it: a real process on a free loopback port, the tiny model,
the official openai client, then SIGTERM / SIGINT -> exit status 0 within seconds."""

import signal
import time

import openai
import pytest

from deepinfer.bin import cli
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")
Served = proc.Served


@pytest.mark.timeout(180)
def test_serve_model_dir_answers_and_stops_on_sigterm(port):
    model_dir = harness.tiny_model_dir()
    models = harness.TEST_CACHE_DIR / "models"
    models_before = sorted(models.iterdir())
    with Served(["--model", str(model_dir), "--max-model-len", "2048", "--served-model-name", "tiny", "alias"],
                proc.serve_env(harness.TEST_CACHE_DIR), port) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        resp = client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
        client.close()
        code, out, err, seconds = served.stop(signal.SIGTERM)
    assert code == 0, err
    assert seconds < proc.STOP_TIMEOUT_S
    assert "Traceback" not in err and "Traceback" not in out
    assert f"at {served.url}" in out
    assert f"curl -N {served.url}/v1/chat/completions" in out
    assert out.rstrip().endswith("Stopped.")
    assert sorted(models.iterdir()) == models_before  # --model given: no built-in model written


@pytest.mark.timeout(180)
def test_serve_builtin_model_sigint_mid_stream_and_api_key(port):
    # DEEPINFER_CACHE_DIR holds the built-in model already (the harness wrote it): no recreation
    env = proc.serve_env(harness.TEST_CACHE_DIR)
    harness.tiny_model_dir()
    with Served(["--api-key", "sekret", "--max-model-len", "2048", "--shutdown-grace", "0.5"], env, port) as served:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sekret", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["deepinfer-tiny"]
        stream = client.completions.create(model="deepinfer-tiny", prompt="a long story", max_tokens=500,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # the request is running in the engine now
        code, out, err, seconds = served.stop(signal.SIGINT)
        # the grace period was too short for 500 tokens: the stream was cut, never finished
        finishes = []
        try:
            for chunk in chunks:
                finishes += [c.finish_reason for c in chunk.choices]
        except openai.APIConnectionError:
            pass  # the server closed the connection mid-stream
        assert "length" not in finishes
        client.close()
    assert code == 0, err
    assert seconds < proc.STOP_TIMEOUT_S
    assert "Traceback" not in err
    assert "Using the built-in tiny model" in out
    assert '$DEEPINFER_API_KEY' in out and "sekret" not in out  # the key itself is never printed


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--port", "x"], "argument --port: invalid int value"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--dtype", "int3"], "argument --dtype: invalid choice"),
    (["--device", "tpu"], "device must be 'cpu', 'cuda' or 'auto'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--api-key", " "], "--api-key must not be blank"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be between 0 and 3600"),
])
def test_bad_options_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    code, err = proc.serve_usage_error(tmp_path, capsys, argv)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("deepinfer serve: ") and message in err, err


def test_missing_or_broken_model_dir_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["serve", "--model", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"deepinfer serve: cannot load {tmp_path}: "), err


def test_port_in_use_is_one_line_error(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        code = cli.main(["serve", "--model", str(harness.tiny_model_dir()), "--port", str(busy), "--no-progress",
                         "--max-model-len", "512"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"deepinfer serve: cannot serve on 127.0.0.1:{busy}"), err


@pytest.mark.timeout(120)
def test_sigterm_while_loading_stops_cleanly(port):
    served = Served(["--max-model-len", "512"], proc.serve_env(harness.TEST_CACHE_DIR), port)
    try:
        deadline = time.monotonic() + proc.START_TIMEOUT_S
        while "Loading" not in served.output()[0]:
            assert served.proc.poll() is None and time.monotonic() < deadline, served.output()
            time.sleep(0.02)
        code, out, err, seconds = served.stop(signal.SIGTERM)
    finally:
        served.__exit__()
    assert code == 0, err
    assert "Traceback" not in err
    # usually the load is still running; on a fast machine it may have finished just before
    assert "Stopped before the model was loaded." in out or out.rstrip().endswith("Stopped."), out
