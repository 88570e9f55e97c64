"""An AsyncEngine process with SWA slot options, for tests/engine/test_swa_async.py (run as a script).

``python swa_async_peer_proc.py MODEL_DIR OPTIONS_JSON``: starts ``AsyncEngine.start(model=...,
**options)`` (so ``swa_directory`` makes it publish and serve its slots), prints ``{"ready": node}``,
then answers JSON commands on stdin, one per line: ``{"prompt": [...], "max_tokens": n}`` ->
``{"tokens": [...], "num_restored": k, "num_saved": s}``. Before answering it waits until the
request's KV blocks reached the KV store and its saved slot reached the directory, so the test
can continue the conversation elsewhere at once.
"""

from __future__ import annotations

import asyncio
import json
import sys

from deepinfer.engine.api.async_engine import AsyncEngine
from deepinfer.engine.api.sampling_params import SamplingParams


async def main(model_dir: str, options: dict) -> None:
    engine = await AsyncEngine.start(model=model_dir, **options)
    loop = asyncio.get_running_loop()
    try:
        print(json.dumps({"ready": engine.swa_peer.node_name if engine.swa_peer else ""}), flush=True)
        n = 0
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            n += 1
            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            tokens: list[int] = []
            async for out in engine.generate({"prompt_token_ids": cmd["prompt"]}, params, request_id=f"r{n}"):
                tokens += out.outputs[0].token_ids
            offload = engine.core.kv_offload
            if offload is not None:
                # the idle pipeline queued the last copy-outs on the device thread: let them run,
                # then wait for the store writes
                await loop.run_in_executor(engine._device, lambda: None)
                await loop.run_in_executor(None, offload.wait_for_writes, 30.0)
            if engine.swa_peer is not None:
                await engine.swa_peer.publish_now()
            stats = engine.swa_slots.stats
            print(json.dumps({"tokens": tokens, "num_restored": stats.num_restored, "num_saved": stats.num_saved}),
                  flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
