"""One rank of an expert-parallel engine group, as a process of its own:

    python -m deepinfer.runtime.ep.rank_worker '{"model": DIR, "options": {...}, "rank": r,
        "size": n, "init_method": "tcp://127.0.0.1:P", "settings": {...}, "timeout_s": 30}'

It runs an ``AsyncEngine`` whose runner is an ``EpRunner`` (``EngineOptions.expert_parallel``)
and serves its front (engine_group.py) over stdin/stdout, in frames of a 4-byte length and one
message (transport/protocol/ep.py): ``EpGenerate`` / ``EpAbort`` / ``EpStop`` in; ``EpReady``
once, then ``EpOutput`` deltas and ``EpRequestFailed`` out, and ``EpRankStats`` every
``STATS_INTERVAL_S``. Logs go to stderr.

It exits when its front goes (end of stdin), on ``EpStop``, and when the group breaks (a peer
died or timed out): its requests are failed first, with the group's reason, so nothing waits on
a rank that cannot step again. Exit status: 0 after a stop, 3 after the group broke.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys

from deepinfer.transport.codec import Codec
from deepinfer.transport.protocol import (
    EpAbort,
    EpGenerate,
    EpOutput,
    EpRankReply,
    EpRankRequest,
    EpRankStats,
    EpReady,
    EpRequestFailed,
    EpStop,
)

log = logging.getLogger(__name__)
EXIT_GROUP_BROKEN = 3
STATS_INTERVAL_S = 1.0  # how often a rank sends its engine's figures to the front
MAX_FRAME_BYTES = 64 * 1024 * 1024


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes, or None at a clean end of input."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    (size,) = struct.unpack("<I", head)
    return await reader.readexactly(size)


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


class RankServer:
    def __init__(self, engine, writer: asyncio.StreamWriter):
        from deepinfer.engine.kv.handoff import decode_params, encode_output

        self.engine, self.writer = engine, writer
        self._decode_params, self._encode_output = decode_params, encode_output
        self._out = Codec(EpRankReply)
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, msg) -> None:
        self.writer.write(frame(self._out.encode(msg)))

    def generate(self, msg: EpGenerate) -> None:
        self.tasks[msg.request_id] = asyncio.get_running_loop().create_task(self._run(msg))

    async def _run(self, msg: EpGenerate) -> None:
        try:
            params = self._decode_params(msg.params)
            async for out in self.engine.generate({"prompt_token_ids": msg.prompt_token_ids}, params,
                                                  request_id=msg.request_id):
                self.send(EpOutput(msg.request_id, self._encode_output(out)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the front, typed by name
            runner = self.engine.core.runner
            if _group_broken(runner):  # the step failed because the group broke: say so, not "a step failed"
                self.send(EpRequestFailed(msg.request_id, "EpGroupError", _reason(runner)))
            else:
                self.send(EpRequestFailed(msg.request_id, type(exc).__name__,
                                          str(exc).splitlines()[0] if str(exc) else ""))
        finally:
            self.tasks.pop(msg.request_id, None)
            await self.writer.drain()

    def send_stats(self) -> None:
        st = self.engine.stats()
        self.send(EpRankStats(st.num_running, st.num_waiting, st.kv_cache_usage, dict(st.ep or {})))

    def fail_all(self, reason: str) -> None:
        for rid, task in list(self.tasks.items()):
            task.cancel()
            self.send(EpRequestFailed(rid, "EpGroupError", reason))
        self.tasks.clear()


async def serve(config: dict) -> int:
    from deepinfer.engine.api.async_engine import AsyncEngine
    from deepinfer.engine.parallel.settings import EpSettings, ExpertParallelSpec

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout.buffer)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    spec = ExpertParallelSpec(rank=config["rank"], size=config["size"], init_method=config["init_method"],
                              settings=EpSettings(**config.get("settings", {})),
                              timeout_s=config.get("timeout_s", 30.0))
    engine = await AsyncEngine.start(config["model"], **config.get("options", {}), expert_parallel=spec)
    info = engine.model_info
    server = RankServer(engine, writer)
    server.send(EpReady(info.name, info.max_model_len, info.vocab_size, list(info.eos_token_ids), info.created))
    await writer.drain()
    runner = engine.core.runner
    codec = Codec(EpRankRequest, MAX_FRAME_BYTES)
    frames = loop.create_task(read_frame(reader))
    status = 0
    stats_due = 0.0
    try:
        while True:
            done, _ = await asyncio.wait({frames}, timeout=0.1)
            if _group_broken(runner):
                server.fail_all(_reason(runner))
                status = EXIT_GROUP_BROKEN
                break
            if loop.time() >= stats_due:
                server.send_stats()
                stats_due = loop.time() + STATS_INTERVAL_S
            if not done:
                continue
            raw = frames.result()
            if raw is None:  # the front went away
                break
            msg = codec.decode(raw)
            if isinstance(msg, EpStop):
                break
            if isinstance(msg, EpGenerate):
                server.generate(msg)
            elif isinstance(msg, EpAbort):
                await engine.abort(msg.request_id)
            frames = loop.create_task(read_frame(reader))
        await writer.drain()
    finally:
        frames.cancel()
    await engine.shutdown()
    if status == 0:
        await loop.run_in_executor(None, runner.close)  # the group's last round: every rank leaves at once
    return status


def _group_broken(runner) -> bool:
    return bool(getattr(runner, "is_broken", False))  # EpRunner (or a wrapper passing it through)


def _reason(runner) -> str:
    return getattr(runner, "broken_reason", None) or "the EP group broke"


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s ep-rank %(levelname)s %(message)s")
    config = json.loads(sys.argv[1])
    try:
        status = asyncio.run(serve(config))
    except Exception as exc:  # noqa: BLE001 - a rank that cannot start says why, in one line
        print(f"deepinfer ep rank {config.get('rank')}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        status = 1
    # threads of a broken group (gloo, the idle poller) may still wait on dead peers: do not join them
    os._exit(status)


if __name__ == "__main__":
    main()
