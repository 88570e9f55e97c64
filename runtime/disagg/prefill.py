"""The prefill engine of a disaggregated cluster.

Per ``PdDispatch`` (gateway -> here, one engine request ``<id>@<attempt>``):

1. run the prompt (plus any resumed outputs) with ``max_tokens`` forced to one new token;
2. right after the step that sampled it commits, copy the request's blocks + SWA slot to host
   memory (engine/kv/handoff.py) — the copy is the "prefill-held KV" and holds a lease;
3. if that token already ends the request, reply ``FINISHED`` with the final delta;
4. else push the KV to the chosen decode instance on the data plane (``PdKvPush`` as the
   transfer's meta), then ``PdKvReady``; the decode engine imports and answers ``PdHandoffAck``;
   only an OK ack completes the handoff, then the copy is freed and the gateway gets
   ``HANDED_OFF`` (the decode engine streams the rest to it).

SWA slots: with ``EngineServiceConfig.swa_directory`` the engine shares its slot store through
the gateway's SWA directory (``SwaPeer``: it lists the slots of finished prompts and serves them,
named as this node instance, so the gateway's PeerDown drops them) and, before running a
dispatched prompt, fetches the slot at the prefix hit it will get from another prefill engine
(bounded by ``swa_fetch_deadline_s``; a miss replays).

Every way the handoff can end without an ack frees the copy at once and answers the gateway
with an error naming why (it re-dispatches or fails the request, per its policy): the decode
instance's PeerDown (or restart), lease expiry without renewal, a failed transfer, a refusal,
an abort (``PdAbort`` from the gateway; the decode engine is then told with a ``PdAbort`` too).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import msgspec

from deepinfer.cache.block_hash import MultiModalSpan
from deepinfer.cache.swa_peer import SwaPeer
from deepinfer.engine.api.protocol import InvalidPromptError
from deepinfer.engine.kv.handoff import (
    KvCapture,
    add_resumed,
    decode_params,
    encode_logprobs,
    encode_output,
    ends_at_prefill,
    export_kv,
    prefill_params,
    with_image_embeddings,
)
from deepinfer.engine.kv.swa_slots import SwaSlotRunner
from deepinfer.engine.mm.inputs import MultiModalInput
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.runtime.disagg.engine_service import DisaggEngineService
from deepinfer.runtime.disagg.handoff_metrics import FailureKind
from deepinfer.runtime.disagg.leases import LeaseTable
from deepinfer.runtime.encoder.inbox import EmbeddingInbox
from deepinfer.transport.errors import DeadlineExceeded, RemoteError, TransferFailed, TransportError
from deepinfer.transport.protocol import (
    EngineRef,
    ErrorCode,
    HandoffStatus,
    PdAbort,
    PdDispatch,
    PdDispatchReply,
    PdDone,
    PdHandoffAck,
    PdKvPush,
    PdKvReady,
    PdLeaseRenew,
    PeerDown,
)
from deepinfer.transport.protocol import (
    Role as WireRole,
)

log = logging.getLogger(__name__)
IMAGE_WAIT_S = 30.0  # a dispatch's image embeddings must be in the inbox by then


def engine_request_id(request_id: str, attempt: int) -> str:
    return f"{request_id}@{attempt}"


class HandoffLost(TransportError):
    """The handoff ended without an ack; ``kind`` is a FailureKind."""

    def __init__(self, message: str, kind: str):
        super().__init__(message, ErrorCode.UNAVAILABLE)
        self.kind = kind


class PrefillService(DisaggEngineService):
    wire_role = WireRole.PREFILL

    def __init__(self, parts, config):
        super().__init__(parts, config)
        self.capture = KvCapture()
        self.leases = LeaseTable(config.lease_s)
        self._handoff_ids = itertools.count(1)
        self._handoff_tasks: dict[int, asyncio.Task] = {}
        self._lost_reason: dict[int, HandoffLost] = {}
        self._erid2dispatch: dict[str, asyncio.Task] = {}
        self.swa_peer: SwaPeer | None = None
        self.inbox: EmbeddingInbox | None = None  # image embeddings from encoder nodes (runtime/encoder)

    async def _start_extra(self) -> None:
        self._tasks.append(asyncio.create_task(self._expire_leases(), name=f"{self.node_name}-leases"))
        if self.core.config.image_token_id is not None and self.config.data_address:
            # a model that reads images: their embeddings arrive from encoder nodes on the data address
            self.inbox = EmbeddingInbox(self.config.data_address, ctx=self.node.ctx,
                                        hidden_size=self.core.config.hidden_size, name=f"{self.node_name}-embeds")
            await self.inbox.start()
        swa = self.parts.swa_slots
        if self.config.swa_directory and swa is not None and isinstance(self.core.runner, SwaSlotRunner):
            self.swa_peer = await SwaPeer(swa.store, directory_address=self.config.swa_directory,
                                          node_name=self.node_name, instance_id=self.instance_id,
                                          host=self.config.swa_peer_host, ctx=self.node.ctx).start()
            swa.fetcher = self.swa_peer.fetcher

    async def _stop_extra(self) -> None:
        if self.inbox is not None:
            await self.inbox.close()
            self.inbox = None
        if self.swa_peer is not None:
            self.parts.swa_slots.fetcher = None
            await self.swa_peer.close()
            self.swa_peer = None

    def _on_scheduled(self, plan) -> None:
        self.capture.on_scheduled(plan, self.core.config.scheduler.block_size)

    def _num_held(self) -> tuple[int, int, int]:
        return self.leases.num_held, self.leases.held_bytes, 0

    def _backlog_s(self) -> float:
        # tokens still to compute x the last step's seconds per token: a rough, cheap estimate
        sched = self.core.scheduler
        todo = sum(max(0, r.num_tokens - r.num_computed_tokens) for r in sched.requests.values())
        step = self.core.scheduler.config.max_num_batched_tokens
        return todo / max(step, 1) * max(self.loop.last_step_s, 0.001) if self.loop else 0.0

    async def _handle_request(self, msg: Any) -> Any:
        if isinstance(msg, PdDispatch):
            erid = engine_request_id(msg.request_id, msg.attempt)
            task = asyncio.current_task()
            self._erid2dispatch[erid] = task
            try:
                return await self._dispatch(msg, erid)
            finally:
                self._erid2dispatch.pop(erid, None)
        if isinstance(msg, PdAbort):
            return PdDone(num_affected=self._abort(msg))
        if isinstance(msg, PdLeaseRenew):
            num = self.leases.renew(msg.handoff_ids, msg.decode_instance_id, time.monotonic(), msg.lease_s)
            return PdDone(num_affected=num)
        return await super()._handle_request(msg)

    # ---- dispatch -------------------------------------------------------------------------
    async def _dispatch(self, msg: PdDispatch, erid: str) -> PdDispatchReply:
        self.check_instance(msg.prefill_instance_id, f"dispatch of {msg.request_id!r}")
        if self.is_draining:
            raise TransportError(f"{self.node_name} is draining; dispatch elsewhere", ErrorCode.DRAINING)
        params = decode_params(msg.sampling)
        deadline_s = msg.deadline_s or self.config.default_deadline_s
        swa = self.parts.swa_slots
        if swa is not None and swa.fetcher is not None and self.core.scheduler.config.enable_prefix_caching:
            # the SWA slot at this prompt's prefix hit, from the prefill engine that holds it
            await swa.prefetch_for(self.core.scheduler.kv, list(msg.prompt_token_ids) + list(msg.resume_token_ids))
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        acc = {}

        def on_output(out) -> None:
            if isinstance(out, BaseException):
                if not done.done():
                    done.set_exception(out)
                return
            acc["out"] = merge_output(acc.get("out"), out)
            if out.finished and not done.done():
                kv = self.capture.take(erid)
                # between steps: the blocks were just released and nothing has reused them yet
                done.set_result((acc["out"], kv, export_kv(self.core.runner, kv) if kv is not None else None))

        mm_inputs = await self._image_inputs(msg, erid, deadline_s)
        add_resumed(self.core, erid, msg.prompt_token_ids, prefill_params(params, len(msg.resume_token_ids)),
                    msg.seed, list(msg.resume_token_ids), mm_inputs)
        self.capture.watch(erid)
        self.loop.add_sink(erid, on_output)
        try:
            async with asyncio.timeout(deadline_s):
                out, kv, payload = await done
        except BaseException:
            self.loop.abort(erid)
            self.capture.forget(erid)
            raise
        tokens = out.outputs[0].token_ids
        num_outputs = len(msg.resume_token_ids) + len(tokens)
        num_tokens = len(msg.prompt_token_ids) + num_outputs
        if ends_at_prefill(out, params, num_outputs, num_tokens, self.parts.max_model_len) or kv is None:
            out.request_id = msg.request_id
            return PdDispatchReply(msg.request_id, msg.attempt, HandoffStatus.FINISHED, output=encode_output(out))
        payload = with_image_embeddings(payload, mm_inputs)  # a decode that recomputes the prompt needs them
        push = PdKvPush(
            handoff_id=next(self._handoff_ids), request_id=msg.request_id, attempt=msg.attempt,
            prefill=EngineRef(self.node_name, self.instance_id, self.config.engine_address),
            decode_instance_id=msg.decode.instance_id, prompt_token_ids=list(msg.prompt_token_ids),
            output_token_ids=list(msg.resume_token_ids) + list(tokens), sampling=msg.sampling, seed=msg.seed,
            num_computed_tokens=kv.num_computed_tokens, block_size=self.core.config.scheduler.block_size,
            num_blocks=len(kv.block_ids), buffer_names=payload.names, gateway_name=msg.gateway_name,
            gateway_instance_id=msg.gateway_instance_id, stream_address=msg.stream_address,
            lease_s=self.config.lease_s, first_logprobs=encode_logprobs(out.outputs[0].logprobs),
            prompt_logprobs=encode_logprobs(out.prompt_logprobs), window_start=kv.window_start,
            write_from=kv.write_from, images=list(msg.images))
        reply = await self._hand_off(msg.decode, push, payload)
        tiers = out.metrics.cached_tokens_by_tier if out.metrics is not None else {}
        return msgspec.structs.replace(reply, num_cached_tokens=out.num_cached_tokens,
                                       cached_tokens_by_tier=dict(tiers))

    async def _image_inputs(self, msg: PdDispatch, erid: str, deadline_s: float) -> list[MultiModalInput]:
        """The dispatch's images with the embeddings the encoders pushed (the gateway sent them
        before dispatching: they are here or on their way)."""
        if not msg.images:
            return []
        if self.inbox is None:
            raise InvalidPromptError(f"{self.node_name} takes no image embeddings (no vision model or no data address)")
        try:
            embeds = [await self.inbox.take(erid, i, im.content_hash, timeout_s=min(deadline_s, IMAGE_WAIT_S))
                      for i, im in enumerate(msg.images)]
        except BaseException:
            self.inbox.drop(erid)
            raise
        return [MultiModalInput(MultiModalSpan(im.offset, im.length, im.content_hash), e)
                for im, e in zip(msg.images, embeds)]

    async def _hand_off(self, decode: EngineRef, push: PdKvPush, payload) -> PdDispatchReply:
        t0 = time.perf_counter()
        num_bytes = payload.num_bytes
        self.leases.grant(push.handoff_id, push.request_id, decode.node_name, decode.instance_id,
                          num_bytes, time.monotonic())
        task = asyncio.create_task(self._push(decode, push, payload), name=f"handoff-{push.handoff_id}")
        self._handoff_tasks[push.handoff_id] = task
        try:
            transfer_s = await task
        except asyncio.CancelledError:
            lost = self._lost_reason.pop(push.handoff_id, None)
            if lost is None:  # our own dispatch was cancelled (gateway abort / stop)
                self.metrics.fail(FailureKind.ABORTED)
                asyncio.ensure_future(self._tell_decode_abort(decode, push, "prefill gave up the handoff"))
                raise
            self.metrics.fail(lost.kind)
            asyncio.ensure_future(self._tell_decode_abort(decode, push, str(lost)))
            raise lost from None
        except HandoffLost as lost:
            self.metrics.fail(lost.kind)
            asyncio.ensure_future(self._tell_decode_abort(decode, push, str(lost)))
            raise
        finally:
            self._handoff_tasks.pop(push.handoff_id, None)
            self.leases.release(push.handoff_id)  # the host copy goes with ``payload`` now
            payload.tensors.clear()
        latency = time.perf_counter() - t0
        self.metrics.observe(num_bytes, latency, transfer_s)
        return PdDispatchReply(push.request_id, push.attempt, HandoffStatus.HANDED_OFF,
                               handoff_bytes=num_bytes, handoff_s=latency)

    async def _push(self, decode: EngineRef, push: PdKvPush, payload) -> float:
        try:
            sender = await self.links.bulk(decode)
            meta = _encode(push)
            try:
                result = await sender.send(payload.tensors, meta=meta, timeout_s=self.config.handoff_timeout_s)
            except TransferFailed as exc:
                # One retry on a fresh link: a same-host side channel can drop while the decode
                # instance is still up (seen under heavy CPU load); a dead peer fails again at once.
                log.warning("%s: KV push of %s to %s failed (%s); retrying once", self.node_name,
                            push.request_id, decode.node_name, exc)
                result = await sender.send(payload.tensors, meta=meta, timeout_s=self.config.handoff_timeout_s)
            client = await self.links.rpc(decode)
            ack = await client.request(PdKvReady(push.handoff_id, push.request_id, push.attempt, self.instance_id,
                                                 decode.instance_id), timeout_s=self.config.handoff_timeout_s)
        except (DeadlineExceeded, RemoteError, TransportError) as exc:
            kind = FailureKind.REFUSED if isinstance(exc, RemoteError) else FailureKind.TRANSFER
            raise HandoffLost(f"handoff of {push.request_id!r} to {decode.node_name} failed: {exc}", kind) from None
        if not isinstance(ack, PdHandoffAck) or ack.code != ErrorCode.OK:
            why = ack.message if isinstance(ack, PdHandoffAck) else type(ack).__name__
            kind = FailureKind.NO_ROOM if "no free slot" in why else FailureKind.REFUSED
            raise HandoffLost(f"{decode.node_name} refused the handoff of {push.request_id!r}: {why}", kind)
        return result.seconds

    # ---- losses -----------------------------------------------------------------------------
    def _cancel_handoff(self, handoff_id: int, lost: HandoffLost) -> None:
        task = self._handoff_tasks.get(handoff_id)
        if task is not None and not task.done():
            self._lost_reason[handoff_id] = lost
            task.cancel()

    def _on_peer_down(self, event: PeerDown) -> None:
        if event.role != WireRole.DECODE:
            return
        for lease in self.leases.take_peer(event.node_name, event.instance_id):
            log.warning("%s: decode %s (instance %x) is down (%s): freeing the KV of %s", self.node_name,
                        event.node_name, event.instance_id, event.reason.name, lease.request_id)
            self._cancel_handoff(lease.handoff_id, HandoffLost(
                f"decode engine {event.node_name} went down ({event.reason.name.lower()}) mid-handoff",
                FailureKind.PEER_DOWN))

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.leases.lease_s / 4))
            for lease in self.leases.take_expired(time.monotonic()):
                log.warning("%s: lease on the KV of %s expired (no ack or renewal from %s)", self.node_name,
                            lease.request_id, lease.decode_name)
                self._cancel_handoff(lease.handoff_id, HandoffLost(
                    f"the lease on {lease.request_id!r} expired without an ack from {lease.decode_name}",
                    FailureKind.LEASE_EXPIRED))

    def _abort(self, msg: PdAbort) -> int:
        num = 0
        for erid, task in list(self._erid2dispatch.items()):
            rid, _, attempt = erid.rpartition("@")
            if rid == msg.request_id and (msg.attempt < 0 or int(attempt) == msg.attempt):
                task.cancel()  # its finally aborts the engine request / the handoff
                num += 1
        if self.inbox is not None and msg.attempt >= 0:  # embeddings pushed for a dispatch that never came
            self.inbox.drop(engine_request_id(msg.request_id, msg.attempt))
        return num

    async def _tell_decode_abort(self, decode: EngineRef, push: PdKvPush, reason: str) -> None:
        try:
            client = await self.links.rpc(decode)
            await client.request(PdAbort(push.request_id, push.attempt, reason), timeout_s=1.0)
        except Exception as exc:  # the decode engine may be the one that is gone
            log.debug("%s: abort of %s not delivered to %s: %s", self.node_name, push.request_id, decode.node_name, exc)


_push_encoder = msgspec.msgpack.Encoder()


def _encode(push: PdKvPush) -> bytes:
    return _push_encoder.encode(push)
