"""The test's side of store_load.py: start it inside a host, send commands, read JSON answers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

STORE_LOAD = Path(__file__).with_name("store_load.py")


class StoreLoadClient:
    def __init__(self, cluster, host: str, cluster_file: Path, env: dict[str, str] | None = None):
        self.cluster = cluster
        self.proc = cluster.popen(host, [sys.executable, str(STORE_LOAD), str(cluster_file)], env=env,
                                  label=f"{host}-store-load", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.expect("ready", timeout_s=60)

    def command(self, line: str, timeout_s: float = 60.0) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.expect(line.split()[0], timeout_s)

    def expect(self, cmd: str, timeout_s: float) -> dict:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            state = "still running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
            raise AssertionError(f"store_load gave no answer to {cmd!r} within {timeout_s} s ({state}):\n"
                                 f"{self.cluster.output(self.proc)}")
        reply = json.loads(box[0])
        assert reply.get("cmd") == cmd and "error" not in reply, reply
        return reply

    def quit(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=10)
