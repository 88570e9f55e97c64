"""The VE pool on the tiny V4.1 checkpoint (float32 CPU): three real ``deepinfer node --role encoder``
processes, 32 requests of 1-4 images each sent through the gateway's ``EncoderPool`` to an
``EmbeddingInbox`` (the prefill side) on the data plane. Every image's embeddings equal the
co-located tower's bitwise, every image went to an encoder with the fewest pending image tokens
at its admission, and SIGKILLing one encoder mid-run costs no request (its images are encoded
again on the others)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.models.registry import read_model_config
from deepinfer.runtime.encoder.inbox import EmbeddingInbox
from deepinfer.runtime.encoder.pool import EncoderPool, EncoderRef
from deepinfer.transport.ports import free_tcp_port

NUM_ENCODERS, NUM_REQUESTS = 3, 32
pytestmark = pytest.mark.timeout(180)


def picture(rng: np.random.Generator) -> Image.Image:
    w, h = (int(x) for x in rng.integers(40, 240, 2))
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def cluster_file(path, model_dir, ports) -> list[EncoderRef]:
    lines = ["[engine]", f'model = "{model_dir}"', 'dtype = "float32"', "num_threads = 1", "",
             "[cluster]", "heartbeat_interval_s = 0.2", ""]
    refs = []
    for i in range(NUM_ENCODERS):
        control, events, engine = (f"tcp://127.0.0.1:{ports[3 * i + k]}" for k in range(3))
        lines += ["[[nodes]]", f'name = "enc-{i}"', 'role = "encoder"', f'control = "{control}"',
                  f'events = "{events}"', f'engine = "{engine}"', ""]
        refs.append(EncoderRef(f"enc-{i}", engine))
    path.write_text("\n".join(lines))
    return refs


@pytest.fixture
def encoders(tiny_dir, tmp_path):
    refs = cluster_file(tmp_path / "cluster.toml", tiny_dir, [free_tcp_port() for _ in range(3 * NUM_ENCODERS)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {ref.name: subprocess.Popen([sys.executable, "-m", "deepinfer.bin", "node", "--cluster",
                                         str(tmp_path / "cluster.toml"), "--role", "encoder", "--name", ref.name],
                                        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{ref.name}.log", "w"))
             for ref in refs}
    try:
        yield refs, procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _all_up(pool: EncoderPool, procs, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = await pool.statuses()
        if all(s is not None for s in statuses.values()):
            return
        dead = [n for n, p in procs.items() if p.poll() is not None]
        assert not dead, f"encoder processes exited: {dead}"
        assert time.monotonic() < deadline, f"encoders not up: {statuses}"
        await asyncio.sleep(0.2)


def test_three_encoders_32_requests_one_killed(tiny_dir, encoders):
    refs, procs = encoders
    cfg = read_model_config(tiny_dir)
    local = VisionEncoder.load(tiny_dir, cfg, dtype=torch.float32, device="cpu")  # the co-located tower
    rng = np.random.default_rng(7)
    requests = [[local.prepare(picture(rng)) for _ in range(int(rng.integers(1, 5)))] for _ in range(NUM_REQUESTS)]
    want = [[local.encode(im) for im in images] for images in requests]
    victim = "enc-1"

    async def main():
        inbox = EmbeddingInbox(f"tcp://127.0.0.1:{free_tcp_port()}", hidden_size=cfg.hidden_size)
        await inbox.start()
        pool = await EncoderPool(refs, probe_interval_s=0.2, probe_timeout_s=0.5, record_placements=True).start()
        try:
            await _all_up(pool, procs)
            done = 0
            kill_at = []

            async def one(r: int):
                nonlocal done
                rid = f"req-{r}@0"
                await pool.encode(rid, requests[r], inbox.address)
                got = [await inbox.take(rid, i, im.content_hash, timeout_s=5) for i, im in enumerate(requests[r])]
                done += 1
                return got

            async def kill_mid_run():
                while done < NUM_REQUESTS // 4 or not any(p.encoder == victim for p in pool.placements[-6:]):
                    await asyncio.sleep(0.005)
                kill_at.append(len(pool.placements))
                procs[victim].send_signal(signal.SIGKILL)

            async def staggered(r: int):
                await asyncio.sleep(0.02 * r)  # arrivals spread over ~0.6 s
                return await one(r)

            killer = asyncio.create_task(kill_mid_run())
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(staggered(r) for r in range(NUM_REQUESTS))), 120)
            elapsed = time.monotonic() - start
            await killer
            print(f"\n{NUM_REQUESTS} requests, {sum(map(len, requests))} images "
                  f"({sum(im.num_tokens for images in requests for im in images)} image tokens) in {elapsed:.2f} s")
            return (results, pool.placements, pool.images_by_encoder(), pool.num_reencoded, pool.up, len(inbox),
                    kill_at[0])
        finally:
            await pool.close()
            await inbox.close()

    results, placements, by_encoder, num_reencoded, up, left, kill_at = asyncio.run(main())
    for r, (got, expect) in enumerate(zip(results, want)):
        for i, (g, w) in enumerate(zip(got, expect)):
            assert g.dtype == w.dtype and torch.equal(g, w), f"request {r} image {i} differs from the co-located tower"
    assert procs[victim].poll() is not None and victim not in up
    assert left == 0  # every pushed embedding was taken
    # every image went to an encoder that had the fewest pending image tokens at its admission
    for p in placements:
        assert p.pending_before[p.encoder] == min(p.pending_before.values()), p
    assert sum(by_encoder.values()) == sum(len(images) for images in requests)
    assert all(by_encoder[name] > 0 for name in by_encoder)
    def spread(ps, skip=()):
        return max(max(v for k, v in p.pending_before.items() if k not in skip)
                   - min(v for k, v in p.pending_before.items() if k not in skip) for p in ps)
    largest = max(p.num_tokens for p in placements)
    print(f"images per encoder {by_encoder}, re-encoded after the kill: {num_reencoded}; widest pending-token spread "
          f"at an admission: {spread(placements[:kill_at])} before the kill, {spread(placements, (victim,))} among "
          f"the survivors over the run, {spread(placements)} counting the dead encoder until it was seen down "
          f"(largest image {largest} tokens)")


def test_encoder_service_refuses_bad_requests_and_serves_on(tiny_dir):
    """In one process: malformed encode requests get one-line error replies (the service serves
    on); a good one lands in the inbox equal to the local tower's output."""
    import zmq.asyncio

    from deepinfer.runtime.encoder.service import EncoderService
    from deepinfer.runtime.metrics import MetricsRegistry
    from deepinfer.transport.channels import RequestClient
    from deepinfer.transport.errors import RemoteError
    from deepinfer.transport.protocol.ve import VeEncode, VeEncoded, VeReply, VeStatus, VeStatusRequest

    cfg = read_model_config(tiny_dir)
    vision = VisionEncoder.load(tiny_dir, cfg, dtype=torch.float32, device="cpu")
    image = vision.prepare(picture(np.random.default_rng(1)))
    pixels = image.pixels.contiguous().view(torch.uint8).numpy()

    async def main():
        node = SimpleNamespace(name="enc", instance_id=7, ctx=zmq.asyncio.Context.instance(), metrics=MetricsRegistry())
        service = EncoderService(vision, f"tcp://127.0.0.1:{free_tcp_port()}")
        inbox = EmbeddingInbox(f"tcp://127.0.0.1:{free_tcp_port()}", hidden_size=cfg.hidden_size)
        await service.start(node)
        await inbox.start()
        client = await RequestClient(service.address, VeReply).start()
        try:
            def encode(**kw):
                fields = dict(request_id="r", image_index=0, grid=list(image.grid), num_tokens=image.num_tokens,
                              content_hash=image.content_hash, pixel_dtype="bfloat16", inbox_address=inbox.address)
                return VeEncode(**{**fields, **kw})
            errors = []
            for msg, buffers in [(encode(), [pixels[:-6]]), (encode(pixel_dtype="nope"), [pixels]),
                                 (encode(num_tokens=10_000), [pixels]), (encode(), [])]:
                with pytest.raises(RemoteError) as err:
                    await client.request(msg, buffers=buffers, timeout_s=10)
                errors.append(str(err.value))
            reply = await client.request(encode(), buffers=[pixels], timeout_s=30)
            got = await inbox.take("r", 0, image.content_hash, timeout_s=5)
            status = await client.request(VeStatusRequest(), timeout_s=5)
            return errors, reply, got, status
        finally:
            await client.close()
            await inbox.close()
            await service.stop()

    errors, reply, got, status = asyncio.run(main())
    assert all("\n" not in e for e in errors), errors
    assert "do not fit a grid" in errors[0] and "is not a torch dtype" in errors[1]
    assert "outside this model's" in errors[2] and "one attachment" in errors[3]
    assert isinstance(reply, VeEncoded) and reply.num_tokens == image.num_tokens
    assert torch.equal(got, vision.encode(image))
    assert isinstance(status, VeStatus) and status.num_encoded == 1 and status.num_pending_image_tokens == 0


def test_no_encoder_up_is_a_clear_error(tiny_dir):
    """Encoders that never answer are seen down by the probes; a request then fails at once with
    EncoderUnavailable naming the cause (and a request cut off by its deadline says so)."""
    from deepinfer.runtime.encoder.pool import EncoderUnavailable

    vision = VisionEncoder.for_config(read_model_config(tiny_dir))
    image = vision.prepare(picture(np.random.default_rng(2)))
    refs = [EncoderRef(f"gone-{i}", f"tcp://127.0.0.1:{free_tcp_port()}") for i in range(2)]

    async def main():
        pool = await EncoderPool(refs, probe_interval_s=0.05, probe_timeout_s=0.1).start()
        try:
            loop = asyncio.get_running_loop()
            never = loop.create_future()
            with pytest.raises(EncoderUnavailable, match="not encoded before its deadline"):
                await pool.encode_until("r1", [image], "tcp://127.0.0.1:1", cut_off=never, deadline=loop.time() + 0.05)
            while pool.up:
                await asyncio.sleep(0.02)
            start = loop.time()
            with pytest.raises(EncoderUnavailable, match="no vision encoder is up to encode r2's images"):
                await pool.encode("r2", [image], "tcp://127.0.0.1:1")
            return loop.time() - start
        finally:
            await pool.close()

    assert asyncio.run(asyncio.wait_for(main(), 20)) < 0.5
