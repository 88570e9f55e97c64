"""A `deepinfer serve` child process for tests: started on a port, ready once /health answers,
stopped by a signal (or killed when the test leaves early)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

DEEPINFER = [sys.executable, "-m", "deepinfer.bin"]
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0


def serve_env(cache_dir: Path) -> dict[str, str]:
    # the server tests run on the random tiny model the harness wrote (not the shipped trained one)
    return {**os.environ, "DEEPINFER_CACHE_DIR": str(cache_dir), "DEEPINFER_LOG_LEVEL": "WARNING",
            "DEEPINFER_BUILTIN_MODEL": "random"}


class Served:
    """A `deepinfer serve` child process; always killed at the end of the test. Its output goes
    to temp files (a pipe nobody reads could fill up and stall a long-running server)."""

    def __init__(self, args: list[str], env: dict[str, str], port: int):
        self.url = f"http://127.0.0.1:{port}"
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(DEEPINFER + ["serve", "--port", str(port), "--no-progress", *args], env=env,
                                     stdout=self._out, stderr=self._err, text=True)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far."""
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]

    def __enter__(self) -> Served:
        try:
            self._wait_health()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_health(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out, err = self.output()
                pytest.fail(f"deepinfer serve exited with {self.proc.returncode} before it was ready:\n{out}\n{err}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if json.load(resp) == {"status": "ok"}:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        pytest.fail(f"deepinfer serve did not answer {self.url}/health within {START_TIMEOUT_S} s")

    def stop(self, sig: int) -> tuple[int, str, str, float]:
        """Send ``sig``; (exit status, stdout, stderr, seconds until it exited)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=STOP_TIMEOUT_S)
        seconds = time.monotonic() - t0
        return (self.proc.returncode, *self.output(), seconds)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


def serve_usage_error(tmp_path: Path, capsys, argv: list[str]) -> tuple[int, str]:
    """``deepinfer serve --model <a stub model dir> *argv`` in this process, expected to be
    refused: (exit code, its stderr stripped). argparse errors exit and CliErrors return the
    code; ``sys.exit`` turns both into SystemExit."""
    from deepinfer.bin import cli

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        sys.exit(cli.main(["serve", "--model", str(model), *argv]))
    return info.value.code, capsys.readouterr().err.strip()
