"""An expert-parallel engine group behind one ``EngineClient``: ``deepinfer serve --ep N``.

    gateway --generate--> EpEngineGroup --EpGenerate--> rank r (process: AsyncEngine over an EpRunner)
                                        <--EpOutput----                 | MoE exchanges: gloo / NCCL
                                                                        v
                                                                rank 0 .. N-1, in lockstep

The front starts N rank processes (rank_worker.py), one engine replica each (attention is data-
parallel: a request runs on one rank, the one with the fewest requests in flight), and streams
each request's deltas back. The ranks form the EP group among themselves at a fresh port.

A rank that dies takes the group with it (its experts serve every rank's tokens). The front sees
the exit at once (end of the rank's stdout), fails every request in flight on every rank with
``EpRankLostError`` naming the rank and its exit status, stops the other ranks and starts a new
group; requests that arrive meanwhile wait for it (up to ``ready_timeout_s``). A group that
cannot start ``max_failed_starts`` times in a row is dead (``EngineDeadError``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.api.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    EngineStepError,
    InvalidPromptError,
    ModelInfo,
)
from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.runtime.ep.rank_worker import frame, read_frame
from deepinfer.engine.parallel.settings import EpSettings, EpSettingsError
from deepinfer.transport.codec import Codec
from deepinfer.transport.errors import TransportError
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
_INPUT_ERRORS = ("ValueError", "SamplingParamsError", "StructuredOutputError")


# how long a rank that reports a broken group waits for the rank that broke it to exit
BROKEN_GRACE_S = 2.0


class EpRankLostError(EngineStepError):
    """An EP rank died (or the group broke) while this request ran; the group restarts."""


@dataclass(eq=False)
class _Rank:
    index: int
    proc: asyncio.subprocess.Process
    outstanding: set[str] = field(default_factory=set)
    stats: EpRankStats | None = None  # its latest figures (rank_worker.STATS_INTERVAL_S)


class EpEngineGroup:
    """``EngineClient`` over an EP group of rank processes (module docstring)."""

    def __init__(self, model: str | Path, size: int, options: dict, settings: EpSettings, *,
                 timeout_s: float = 30.0, ready_timeout_s: float = 600.0, max_failed_starts: int = 3):
        if not isinstance(size, int) or size < 1:
            raise EpSettingsError(f"--ep must be an integer >= 1, got {size!r}")
        self.model, self.size, self.options, self.settings = str(model), size, dict(options), settings
        self.timeout_s, self.ready_timeout_s, self.max_failed_starts = timeout_s, ready_timeout_s, max_failed_starts
        self._codec_out = Codec(EpRankRequest)
        self._codec_in = Codec(EpRankReply, 64 * 1024 * 1024)
        self._ranks: list[_Rank] = []
        self._requests: dict[str, tuple[_Rank, asyncio.Queue]] = {}
        self._up = asyncio.Event()
        self._info: ModelInfo | None = None
        self._tokenizer = None
        self._generation = 0  # group incarnations: a reader of an old one changes nothing
        self._dead_reason: str | None = None
        self._closed = False
        self._supervisor: asyncio.Task | None = None
        self._lost = asyncio.Queue()
        self._broken_generations: set[int] = set()
        self.num_restarts = 0
        self.last_loss: str | None = None

    @classmethod
    async def start(cls, model: str | Path, *, ep_size: int, ep_settings: EpSettings | dict | None = None,
                    ep_timeout_s: float = 30.0, **options) -> EpEngineGroup:
        """Start the group and wait until every rank is ready. ``options``: EngineOptions fields."""
        settings = ep_settings if isinstance(ep_settings, EpSettings) else EpSettings(**(ep_settings or {}))
        group = cls(model, ep_size, options, settings, timeout_s=ep_timeout_s)
        if not options.get("skip_tokenizer_init"):
            from deepinfer.engine.text.tokenizer import Tokenizer

            group._tokenizer = Tokenizer.from_dir(model)
        try:
            await group._start_group()
        except BaseException:
            await group.shutdown()
            raise
        group._supervisor = asyncio.get_running_loop().create_task(group._supervise(), name="ep-group-supervisor")
        return group

    # ---- EngineClient -----------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        assert self._info is not None, "the group has not started"
        return self._info

    @property
    def tokenizer(self):
        return self._tokenizer

    def stats(self) -> EngineStats:
        """The group's figures from each rank's latest report: requests summed, the fullest rank's
        KV usage, the group's EP figures (every rank counts the same steps and re-placements: the
        largest of each, ``replacement_off`` 1 if any rank turned re-placement off), ``ranks`` and
        ``restarts`` of the group."""
        reports = [r.stats for r in self._ranks if r.stats is not None]
        ep: dict[str, float] = {"ranks": float(len(self._ranks)), "restarts": float(self.num_restarts)}
        for report in reports:
            for name, value in report.ep.items():
                ep[name] = max(ep.get(name, value), value)
        usage = [r.kv_cache_usage for r in reports if r.kv_cache_usage is not None]
        return EngineStats(num_running=sum(len(r.outstanding) for r in self._ranks),
                           num_waiting=sum(r.num_waiting for r in reports),
                           kv_cache_usage=max(usage) if usage else None, ep=ep)

    async def check_health(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closed:
            raise EngineDeadError("the EP engine group is shut down")
        if not self._up.is_set():
            raise EngineDeadError(f"the EP group is restarting ({self.last_loss})")

    async def generate(self, prompt, params: SamplingParams | None = None, *,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        from deepinfer.engine.kv.handoff import encode_params

        token_ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt)
        await self._wait_up()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        rank = min(self._ranks, key=lambda r: (len(r.outstanding), r.index))
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[request_id] = (rank, queue)
        rank.outstanding.add(request_id)
        finished = False
        try:
            self._send(rank, EpGenerate(request_id, token_ids, encode_params(params or SamplingParams())))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._requests.pop(request_id, None)
            rank.outstanding.discard(request_id)
            if not finished and rank in self._ranks:
                self._send(rank, EpAbort(request_id))

    async def abort(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None and entry[0] in self._ranks:
            self._send(entry[0], EpAbort(request_id))

    async def shutdown(self) -> None:
        self._closed = True
        self._up.clear()
        if self._supervisor is not None:
            self._supervisor.cancel()
        self._fail_all(EngineDeadError("the EP engine group is shut down"))
        await self._stop_ranks(self._ranks, graceful=True)
        self._ranks = []

    # ---- the group's life -----------------------------------------------------------------------------
    async def _wait_up(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closed:
            raise EngineDeadError("the EP engine group is shut down")
        try:
            await asyncio.wait_for(self._up.wait(), self.ready_timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the EP group did not come back within {self.ready_timeout_s:.0f} s "
                                  f"({self.last_loss})") from None
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    async def _start_group(self) -> None:
        """Start ranks until a group forms, at most max_failed_starts times in a row."""
        for attempt in range(1, self.max_failed_starts + 1):
            self._generation += 1
            port = _free_port()  # where this incarnation's ranks meet
            ranks = [await self._spawn(r, port) for r in range(self.size)]
            try:
                infos = await asyncio.wait_for(asyncio.gather(*(self._read_ready(r) for r in ranks)),
                                               self.ready_timeout_s)
            except (asyncio.TimeoutError, EOFError, TransportError) as exc:
                await self._stop_ranks(ranks, graceful=False)
                why = f"timed out after {self.ready_timeout_s:.0f} s" if isinstance(exc, asyncio.TimeoutError) else exc
                log.error("EP group start %d of %d failed: %s", attempt, self.max_failed_starts, why)
                self.last_loss = f"the group could not start: {why}"
                continue
            first = infos[0]
            self._info = ModelInfo(first.name, first.max_model_len, first.vocab_size, tuple(first.eos_token_ids),
                                   first.created)
            self._ranks = ranks
            generation = self._generation
            for rank in ranks:
                asyncio.get_running_loop().create_task(self._read(rank, generation), name=f"ep-rank{rank.index}")
            self._up.set()
            log.info("EP group up: %d ranks (pids %s)", self.size, ", ".join(str(r.proc.pid) for r in ranks))
            return
        self._dead_reason = f"the EP group failed to start {self.max_failed_starts} times ({self.last_loss})"
        raise EngineDeadError(self._dead_reason)

    async def _spawn(self, rank: int, port: int) -> _Rank:
        config = dict(model=self.model, options=self.options, rank=rank, size=self.size,
                      init_method=f"tcp://127.0.0.1:{port}", settings=asdict(self.settings), timeout_s=self.timeout_s)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deepinfer.runtime.ep.rank_worker", json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return _Rank(rank, proc)

    async def _read_ready(self, rank: _Rank) -> EpReady:
        raw = await read_frame(rank.proc.stdout)
        if raw is None:
            code = await rank.proc.wait()
            raise EOFError(f"EP rank {rank.index} (pid {rank.proc.pid}) exited with status {code} while starting")
        msg = self._codec_in.decode(raw)
        if not isinstance(msg, EpReady):
            raise TransportError(f"EP rank {rank.index} sent {type(msg).__name__} before EpReady")
        return msg

    async def _read(self, rank: _Rank, generation: int) -> None:
        from deepinfer.engine.kv.handoff import decode_output

        why = None
        try:
            while True:
                raw = await read_frame(rank.proc.stdout)
                if raw is None:
                    break
                msg = self._codec_in.decode(raw)
                if isinstance(msg, EpOutput):
                    self._put(msg.request_id, decode_output(msg.output))
                elif isinstance(msg, EpRequestFailed) and msg.error == "EpGroupError":
                    # the group broke under this rank: which rank caused it is known only once a
                    # process exits; every request in flight is failed then, with that cause
                    self._on_group_broken(rank, generation, msg.message)
                elif isinstance(msg, EpRequestFailed):
                    self._put(msg.request_id, _error(msg))
                elif isinstance(msg, EpRankStats):
                    rank.stats = msg
        except (TransportError, asyncio.IncompleteReadError, ConnectionError) as exc:
            why = f"a bad frame from it ({exc})"
        if generation != self._generation or self._closed:
            return
        code = await rank.proc.wait() if why is None else None
        why = why or f"exited with status {code}"
        self._lost.put_nowait((generation, f"EP rank {rank.index} (pid {rank.proc.pid}) {why}"))

    def _on_group_broken(self, rank: _Rank, generation: int, message: str) -> None:
        """A surviving rank says the group broke (a peer vanished mid-collective). Give a rank
        that died ``BROKEN_GRACE_S`` to exit so the loss names it; if none exits, the group broke
        for another reason (a timeout): report what the rank said."""
        if generation != self._generation or generation in self._broken_generations:
            return
        self._broken_generations.add(generation)
        ranks = list(self._ranks)

        async def name_the_cause() -> None:
            exits = [asyncio.ensure_future(r.proc.wait()) for r in ranks]
            try:
                await asyncio.wait(exits, timeout=BROKEN_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for e in exits:
                    e.cancel()
            if not any(r.proc.returncode is not None for r in ranks):  # a dead rank's reader reports itself
                self._lost.put_nowait((generation, f"EP rank {rank.index} (pid {rank.proc.pid}) lost the group: "
                                                   f"{message}"))

        asyncio.get_running_loop().create_task(name_the_cause(), name=f"ep-broken{generation}")

    async def _supervise(self) -> None:
        """On a lost rank: fail everything in flight, stop the group, start a new one."""
        while True:
            generation, reason = await self._lost.get()
            if generation != self._generation or self._closed:
                continue
            self._up.clear()
            self.last_loss = reason
            log.error("%s: failing %d requests in flight, restarting the group", reason, len(self._requests))
            self._fail_all(EpRankLostError(f"{reason}; the request was failed and the EP group restarts"))
            await self._stop_ranks(self._ranks, graceful=False)
            self._ranks = []
            self.num_restarts += 1
            try:
                await self._start_group()
            except EngineDeadError:
                self._fail_all(EngineDeadError(self._dead_reason))
                return

    def _put(self, request_id: str, item) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            entry[1].put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for rank, queue in list(self._requests.values()):
            queue.put_nowait(exc)
            rank.outstanding.clear()

    def _send(self, rank: _Rank, msg) -> None:
        if rank.proc.stdin is not None and not rank.proc.stdin.is_closing():
            rank.proc.stdin.write(frame(self._codec_out.encode(msg)))

    async def _stop_ranks(self, ranks: list[_Rank], *, graceful: bool) -> None:
        for rank in ranks:
            if rank.proc.returncode is None:
                if graceful:
                    self._send(rank, EpStop())
                else:
                    rank.proc.kill()
        deadline = time.monotonic() + (10.0 if graceful else 5.0)
        for rank in ranks:
            try:
                await asyncio.wait_for(rank.proc.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                rank.proc.kill()
                await rank.proc.wait()


def _error(msg: EpRequestFailed) -> BaseException:
    """A rank's typed failure as the exception an engine in this process would have raised."""
    if msg.error == "InvalidPromptError":
        return InvalidPromptError(msg.message)
    if msg.error == "EngineOverloadedError":
        return EngineOverloadedError(msg.message)
    if msg.error in _INPUT_ERRORS:
        return ValueError(msg.message)
    if msg.error in ("EpGroupError", "EngineStepError"):
        return EpRankLostError(msg.message)
    return EngineStepError(f"{msg.error}: {msg.message}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
