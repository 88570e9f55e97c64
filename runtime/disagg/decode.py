"""The decode engine of a disaggregated cluster.

Handoffs arrive in two parts: the bulk transfer (KV buffers, ``PdKvPush`` as its meta) on the
data address, then ``PdKvReady`` on the engine RPC. On ``PdKvReady`` the engine imports the KV
between two steps (engine/kv/handoff.py ``admit_prefilled``: own blocks + slot, straight into
RUNNING) and answers ``PdHandoffAck``; from then on every delta of the request goes to the
gateway's stream (``PdOutput``), the first one being the token the prefill sampled. The step
loop is pipelined (engine_loop.py): an import stops it at the next step boundary, so the
import is queued only once the engine has room for it.

While no slot or blocks are free it keeps the transfer and renews the prefill's lease
(``PdLeaseRenew``) until the handoff deadline, then refuses (the prefill frees its copy and the
gateway re-dispatches). Transfers nobody claims (their prefill died between push and ready)
are dropped after ``handoff_timeout_s``. A push addressed to a previous instance of this engine
is dropped on arrival and its ready refused: a restarted engine never imports old state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.engine.kv.handoff import (
    KvPayload,
    NoRoom,
    PrefilledRequest,
    admit_prefilled,
    decode_logprobs,
    decode_params,
    decode_prompt_logprobs,
    encode_output,
    has_room,
    split_image_embeddings,
)
from deepinfer.runtime.disagg.engine_service import DisaggEngineService
from deepinfer.runtime.disagg.handoff_metrics import FailureKind
from deepinfer.runtime.disagg.prefill import engine_request_id
from deepinfer.transport.channels import StreamSender
from deepinfer.transport.codec import Codec
from deepinfer.transport.dataplane import BulkReceiver, BulkTransfer
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import (
    EngineRef,
    ErrorCode,
    PdAbort,
    PdDone,
    PdFailed,
    PdHandoffAck,
    PdKvPush,
    PdKvReady,
    PdLeaseRenew,
    PdOutput,
)
from deepinfer.transport.protocol import (
    Role as WireRole,
)

log = logging.getLogger(__name__)

_ARRIVAL_WAIT_S = 5.0  # a ready may overtake its transfer's last bytes by this much at most

# A handoff is named by its prefill *instance* and that prefill's handoff counter: every prefill
# counts from 1, so the counter alone collides as soon as two prefills hand off to one decode.
HandoffKey = tuple[int, int]  # (prefill instance id, handoff id)


@dataclass(slots=True)
class _Arrival:
    push: PdKvPush
    transfer: BulkTransfer
    arrived_at: float


class _GatewayStream:
    """Ordered PdOutput/PdFailed messages to one gateway's PULL socket."""

    def __init__(self, address: str, ctx, name: str):
        self.sender = StreamSender(address, ctx=ctx, name=name)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.sender.start()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            msg = await self.queue.get()
            try:
                await self.sender.send(msg)
            except Exception as exc:
                log.warning("stream to %s: %s dropped: %s", self.sender.address, type(msg).__name__, exc)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.sender.close()


class DecodeService(DisaggEngineService):
    wire_role = WireRole.DECODE
    is_pipelined = True
    publishes_cache = False  # it prefills nothing: only its store writes go into the gateways' view

    def __init__(self, parts, config):
        super().__init__(parts, config)
        if not config.data_address:
            raise ValueError("a decode engine needs a data address (NodeSpec.data) to receive KV")
        self.receiver: BulkReceiver | None = None
        self._codec = Codec(PdKvPush)
        self._arrived: dict[HandoffKey, _Arrival] = {}
        self._arrival_events: dict[HandoffKey, asyncio.Event] = {}
        self._streams: dict[str, _GatewayStream] = {}
        self._erids: set[str] = set()
        # (request id, attempt or -1) -> until when a late transfer of an aborted attempt is dropped
        self._aborted: dict[tuple[str, int], float] = {}

    async def _start_extra(self) -> None:
        self.receiver = BulkReceiver(self.config.data_address, ctx=self.node.ctx, name=f"{self.node_name}-kv")
        await self.receiver.start()
        self._tasks.append(asyncio.create_task(self._receive(), name=f"{self.node_name}-kv-recv"))
        self._tasks.append(asyncio.create_task(self._sweep_unclaimed(), name=f"{self.node_name}-kv-sweep"))

    async def _stop_extra(self) -> None:
        for arrival in self._arrived.values():
            arrival.transfer.release()
        self._arrived.clear()
        if self.receiver is not None:
            await self.receiver.close()
        for stream in self._streams.values():
            await stream.close()

    def _num_held(self) -> tuple[int, int, int]:
        return 0, 0, len(self._arrived)

    async def _handle_request(self, msg: Any) -> Any:
        if isinstance(msg, PdKvReady):
            return await self._import(msg)
        if isinstance(msg, PdAbort):
            return PdDone(num_affected=self._abort(msg))
        return await super()._handle_request(msg)

    # ---- arrivals -----------------------------------------------------------------------------
    async def _receive(self) -> None:
        async for transfer in self.receiver:
            try:
                push = self._codec.decode(transfer.meta)
            except TransportError as exc:
                log.warning("%s: dropped a KV transfer with a bad header: %s", self.node_name, exc)
                transfer.release()
                continue
            if self._is_aborted(push):
                log.info("%s: dropped KV of aborted %s@%d", self.node_name, push.request_id, push.attempt)
                transfer.release()
                continue
            if push.decode_instance_id != self.instance_id:
                log.warning("%s: dropped KV of %s meant for instance %x (we are %x)", self.node_name,
                            push.request_id, push.decode_instance_id, self.instance_id)
                transfer.release()
                continue
            key = (push.prefill.instance_id, push.handoff_id)
            old = self._arrived.pop(key, None)
            if old is not None:  # a resent transfer (the first one's ack was lost): keep the newest
                old.transfer.release()
            self._arrived[key] = _Arrival(push, transfer, time.monotonic())
            event = self._arrival_events.pop(key, None)
            if event is not None:
                event.set()

    async def _sweep_unclaimed(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            self._aborted = {key: until for key, until in self._aborted.items() if until > now}
            for hid, arrival in list(self._arrived.items()):
                if now - arrival.arrived_at > self.config.handoff_timeout_s:
                    log.warning("%s: KV of %s never claimed (its prefill is gone?): dropped", self.node_name,
                                arrival.push.request_id)
                    del self._arrived[hid]
                    arrival.transfer.release()

    async def _wait_arrival(self, key: HandoffKey) -> _Arrival | None:
        if key not in self._arrived:
            event = self._arrival_events.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), _ARRIVAL_WAIT_S)
            except TimeoutError:
                self._arrival_events.pop(key, None)
        return self._arrived.pop(key, None)

    # ---- import -------------------------------------------------------------------------------
    async def _import(self, msg: PdKvReady) -> PdHandoffAck:
        self.check_instance(msg.decode_instance_id, f"handoff of {msg.request_id!r}")
        arrival = await self._wait_arrival((msg.prefill_instance_id, msg.handoff_id))
        if arrival is None:
            self.metrics.fail(FailureKind.TRANSFER)
            return PdHandoffAck(msg.handoff_id, msg.request_id, ErrorCode.NOT_FOUND,
                                f"{self.node_name} holds no KV transfer for handoff {msg.handoff_id}")
        push, transfer = arrival.push, arrival.transfer
        erid = engine_request_id(push.request_id, push.attempt)
        renew: asyncio.Task | None = None
        try:
            tensors = [transfer.view(i) for i in range(len(push.buffer_names))]
            # image embeddings ride with the KV (a preempted request recomputes its prompt here)
            kv, mm_inputs = split_image_embeddings(KvPayload(list(push.buffer_names), tensors), [
                MultiModalSpan(im.offset, im.length, im.content_hash) for im in push.images])
            pre = PrefilledRequest(
                request_id=erid, prompt_token_ids=list(push.prompt_token_ids),
                output_token_ids=list(push.output_token_ids), params=decode_params(push.sampling), seed=push.seed,
                num_computed_tokens=push.num_computed_tokens, kv=kv,
                window_start=push.window_start, write_from=push.write_from,
                first_logprobs=decode_logprobs(push.first_logprobs),
                prompt_logprobs=decode_prompt_logprobs(push.prompt_logprobs), mm_inputs=mm_inputs)
            stream = await self._stream(push.stream_address)
            deadline = time.monotonic() + self.config.handoff_timeout_s
            while True:
                try:
                    if not has_room(self.core, pre.num_computed_tokens):
                        # checked here, not in the job: a queued job drains the step pipeline
                        raise NoRoom(f"no free slot or blocks for {push.request_id!r} before the handoff deadline")
                    delta = await self.loop.between_steps(lambda: admit_prefilled(self.core, pre))
                    break
                except NoRoom as exc:
                    if time.monotonic() > deadline:
                        self.metrics.fail(FailureKind.NO_ROOM)
                        return PdHandoffAck(msg.handoff_id, msg.request_id, ErrorCode.UNAVAILABLE, str(exc))
                    if renew is None:
                        renew = asyncio.create_task(self._renew_lease(push))
                    await asyncio.sleep(0.01)
        except Exception as exc:
            self.metrics.fail(FailureKind.REFUSED)
            log.warning("%s: import of %s failed: %s", self.node_name, push.request_id, exc)
            return PdHandoffAck(msg.handoff_id, msg.request_id, ErrorCode.HANDLER_FAILED, f"import failed: {exc}")
        finally:
            if renew is not None:
                renew.cancel()
            transfer.release()
        self.metrics.observe(transfer.num_bytes, time.monotonic() - arrival.arrived_at, 0.0)
        attempt, instance = push.attempt, self.instance_id

        def to_gateway(out) -> None:
            if isinstance(out, BaseException):
                stream.queue.put_nowait(PdFailed(push.request_id, attempt, instance, ErrorCode.HANDLER_FAILED, str(out)))
                return
            out.request_id = push.request_id
            stream.queue.put_nowait(PdOutput(push.request_id, attempt, instance, encode_output(out)))
            if out.finished:
                self._erids.discard(erid)

        is_live = erid in self.core.scheduler.requests
        if is_live and self._is_aborted(push):  # the abort came while the import waited for a step boundary
            self.loop.abort(erid)
            return PdHandoffAck(msg.handoff_id, msg.request_id, ErrorCode.NOT_FOUND, f"{push.request_id!r} was aborted")
        if delta is not None:
            to_gateway(delta)
        if is_live:
            self._erids.add(erid)
            self.loop.add_sink(erid, to_gateway)
        elif delta is None or not delta.finished:  # a failed step ended it before its sink was added
            to_gateway(RuntimeError(f"engine {self.node_name} dropped {push.request_id!r} right after importing it"))
        return PdHandoffAck(msg.handoff_id, msg.request_id, ErrorCode.OK)

    async def _renew_lease(self, push: PdKvPush) -> None:
        ref: EngineRef = push.prefill
        renewal = PdLeaseRenew(self.node_name, self.instance_id, [push.handoff_id], push.lease_s)
        while True:
            try:
                client = await self.links.rpc(ref)
                await client.request(renewal, timeout_s=push.lease_s / 3)
            except Exception as exc:
                log.debug("%s: lease renewal to %s failed: %s", self.node_name, ref.node_name, exc)
            await asyncio.sleep(push.lease_s / 3)

    async def _stream(self, address: str) -> _GatewayStream:
        stream = self._streams.get(address)
        if stream is None:
            stream = _GatewayStream(address, self.node.ctx, f"{self.node_name}-to-gateway")
            await stream.start()
            self._streams[address] = stream
        return stream

    def _is_aborted(self, push: PdKvPush) -> bool:
        return (push.request_id, push.attempt) in self._aborted or (push.request_id, -1) in self._aborted

    def _abort(self, msg: PdAbort) -> int:
        # the abort can overtake the transfer it is about: remember it for a while
        self._aborted[(msg.request_id, msg.attempt)] = time.monotonic() + self.config.handoff_timeout_s
        num = 0
        for erid in list(self._erids):
            rid, _, attempt = erid.rpartition("@")
            if rid == msg.request_id and (msg.attempt < 0 or int(attempt) == msg.attempt):
                self._erids.discard(erid)
                self.loop.abort(erid)
                num += 1
        for hid, arrival in list(self._arrived.items()):
            push = arrival.push
            if push.request_id == msg.request_id and (msg.attempt < 0 or push.attempt == msg.attempt):
                del self._arrived[hid]
                arrival.transfer.release()
                num += 1
        return num
