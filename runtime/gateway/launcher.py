"""The embedded server's whole life in one coroutine: start the engine, serve HTTP, shut down.

``launch`` is what ``deepinfer serve`` runs inside the loop it owns. SIGINT and SIGTERM are
handled for the whole life, not only while serving: a signal during the model load stops the
start-up, a signal while serving closes the listener, aborts what is in flight and shuts the
engine down (device thread joined), then ``launch`` returns 0. A second signal while shutting
down is ignored: shutdown is bounded (the engine aborts every request within one step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.runtime.gateway.config import GatewayConfig
from deepinfer.runtime.gateway.embedded import serve, stop_on_signals

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    model_dir: Path
    host: str
    port: int
    gateway: GatewayConfig
    engine_options: dict[str, Any]  # EngineOptions fields (engine/core/factory.py)
    # host the SWA slot directory in this process at this address (tcp://HOST:PORT); the engine
    # here uses it, other engines join with --swa-directory (cache/swa_directory.py)
    swa_directory_bind: str | None = None
    # expert parallel over this many rank processes (runtime/ep/engine_group.py); 1: in process
    ep_size: int = 1
    ep_settings: dict[str, Any] | None = None  # EpSettings fields (engine/parallel/settings.py)


# standalone engines have no heartbeats: an engine whose periodic full slot set (every 2 s,
# cache/swa_peer.py) has not arrived for this long is taken for dead and its slots dropped
SWA_DIRECTORY_NODE_TTL_S = 10.0


async def _until_stopped(work: asyncio.Future, stop: asyncio.Event) -> bool:
    """Wait for ``work`` or ``stop``; True if ``work`` finished first (its result is ready)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return work in done


async def launch(spec: LaunchSpec, *, print_fn: Callable[[str], None] = print,
                 stop: asyncio.Event | None = None) -> int:
    """Start the engine on ``spec.model_dir``, serve until a signal (or ``stop``), shut down.
    Start-up errors (bad model directory, bad engine option, port in use) propagate."""
    stop = stop or asyncio.Event()
    directory = None
    options = dict(spec.engine_options)
    if spec.swa_directory_bind:
        from deepinfer.cache.swa_directory import SwaDirectoryService

        directory = SwaDirectoryService(spec.swa_directory_bind, node_ttl_s=SWA_DIRECTORY_NODE_TTL_S)
        options["swa_directory"] = await directory.start()
        print_fn(f"SWA slot directory on {options['swa_directory']}")
    try:
        return await _launch(spec, options, print_fn, stop)
    finally:
        if directory is not None:
            await directory.close()


async def _launch(spec: LaunchSpec, options: dict[str, Any], print_fn: Callable[[str], None],
                  stop: asyncio.Event) -> int:
    from deepinfer.engine.api.async_engine import AsyncEngine

    with stop_on_signals(stop):
        t0 = time.monotonic()
        print_fn(f"Loading {spec.model_dir} ...")
        if spec.ep_size > 1:
            from deepinfer.runtime.ep.engine_group import EpEngineGroup

            print_fn(f"Expert parallel over {spec.ep_size} rank processes")
            starting = asyncio.ensure_future(EpEngineGroup.start(str(spec.model_dir), ep_size=spec.ep_size,
                                                                 ep_settings=spec.ep_settings, **options))
        else:
            starting = asyncio.ensure_future(AsyncEngine.start(model=str(spec.model_dir), **options))
        if not await _until_stopped(starting, stop):
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                engine = await starting  # the load ran to its end in its thread: shut it down
                await engine.shutdown()
            print_fn("Stopped before the model was loaded.")
            return 0
        engine = starting.result()
        info = engine.model_info
        print_fn(f"Model loaded in {time.monotonic() - t0:.1f} s: {info.name} (context {info.max_model_len} "
                 f"tokens, vocabulary {info.vocab_size})")
        try:
            await serve(engine, host=spec.host, port=spec.port, config=spec.gateway, print_fn=print_fn, stop=stop,
                        handle_signals=False)
            print_fn("Shutting down ...")
        finally:
            await engine.shutdown()
    print_fn("Stopped.")
    return 0
