"""The modules one streaming /v1/completions request walks through (ARCHITECTURE.md, "A streaming
completion's walk").

    python tests/engine/walk_modules.py [--list]

The engine and the gateway run in this process on the built-in tiny model; after two warm-up
requests one streaming request (4 tokens) is measured: every call into a file of the package is
recorded, on every thread. Two counts:

- executed: every module with a function called during the request;
- walk: modules called from the HTTP handler, the tasks it starts, the engine's step loop and its
  device thread (aiohttp's middlewares and connection hooks around the handler are not), and not
  only by the model. engine/models/ and kernels/ are never counted.
"""
import asyncio
import os
import sys
import tempfile
import threading
from collections import Counter, defaultdict
from pathlib import Path

import deepinfer

ROOT = str(Path(deepinfer.__file__).resolve().parent) + os.sep
EXCLUDE = ("engine/models/", "kernels/", ".venv/")
executed: Counter = Counter()
callers: dict[str, set] = defaultdict(set)
rooted: set = set()
recording = False
# where the request's own work starts: the HTTP handler, the tasks it starts, the engine's step
# loop and its device thread (aiohttp's middlewares and connection hooks around the handler are not)
ROOTS = {"create_completion", "_pump", "run", "_run", "_run_steps", "_step_loop"}
ROOT_FILES = ("runtime/gateway/serving_completion.py", "runtime/gateway/generation.py", "engine/core/step_loop.py",
              "engine/core/device_chain.py", "engine/step_pipeline.py", "engine/device_chain.py",
              "engine/async_engine.py", "engine/api/async_engine.py")


def _is_rooted(frame) -> bool:
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith(ROOT) and f[len(ROOT):] in ROOT_FILES and frame.f_code.co_name in ROOTS:
            return True
        frame = frame.f_back
    return False


def _ours(f):
    return f.startswith(ROOT) and not f[len(ROOT):].startswith(".venv/")


def prof(frame, event, arg):
    if recording and event == "call":
        f = frame.f_code.co_filename
        if _ours(f):
            mod = f[len(ROOT):]
            executed[mod] += 1
            back = frame.f_back
            # the nearest caller frame of ours (library frames in between are skipped)
            while back is not None and not _ours(back.f_code.co_filename):
                back = back.f_back
            caller = back.f_code.co_filename[len(ROOT):] if back is not None else "<library>"
            callers[mod].add(caller)
            if not caller.startswith(EXCLUDE) and mod not in rooted and _is_rooted(frame):
                rooted.add(mod)
    return None


async def main(max_tokens):
    global recording
    import aiohttp

    from deepinfer import AsyncEngine
    from deepinfer.runtime.gateway import start_gateway
    from deepinfer.runtime.gateway.builtin_model import ensure_builtin_model

    model_dir, _ = ensure_builtin_model(Path(tempfile.gettempdir()) / "deepinfer-walk", show_progress=False)
    engine = await AsyncEngine.start(model=str(model_dir), max_model_len=1024, max_num_seqs=2, num_threads=1)
    gw = await start_gateway(engine, port=0)
    body = {"model": Path(model_dir).name, "prompt": "Hello there, how are you", "max_tokens": max_tokens,
            "stream": True, "temperature": 0.0}
    try:
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(f"{gw.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for _ in r.content:
                        pass
            await one()
            await one()
            recording = True
            await one()
            recording = False
    finally:
        await gw.close()
        await engine.shutdown()


if __name__ == "__main__":
    sys.setprofile(prof)
    threading.setprofile(prof)
    asyncio.run(main(4))
    sys.setprofile(None)
    ex = sorted(m for m in executed if not m.startswith(EXCLUDE))
    walk = sorted(m for m in ex if m in rooted)
    print(f"executed {len(ex)}, walk {len(walk)} (model and kernels not counted; walk: from the handler, the step loop and the device thread, not what only the model calls)")
    if "--list" in sys.argv:
        for m in walk:
            print(f"  {m}  <- {sorted(c for c in callers[m] if not c.startswith(EXCLUDE))}")
        print("  executed, not on the walk:", [m for m in ex if m not in walk])
