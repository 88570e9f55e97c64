"""Run the gateway for an engine inside the caller's event loop.

``start_gateway`` binds and returns at once (tests, embedding servers); ``serve`` is what
``deepinfer serve`` calls: it starts the gateway, prints the URL and a ready-to-paste curl line,
and runs until cancelled or sent SIGINT/SIGTERM. Neither owns the loop: the engine and the
gateway share whatever loop the caller runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aiohttp import web

from deepinfer.engine.api.protocol import EngineClient
from deepinfer.runtime.gateway.app import build_app
from deepinfer.runtime.gateway.config import STATE_KEY, GatewayConfig
from deepinfer.runtime.gateway.connections import GatewayRunner

log = logging.getLogger(__name__)

CLOSE_POLL_S = 0.02
CANCEL_WAIT_S = 5.0  # cancelled handlers only abort their engine requests: quick


@dataclass(slots=True)
class RunningGateway:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    async def close(self) -> None:
        """Stop listening, give requests in flight ``shutdown_grace_s`` to finish, cancel the
        rest (their engine requests are aborted), then close every connection. Bounded: it never
        waits for a long stream to end on its own."""
        state = self.app[STATE_KEY]
        for site in list(self.runner.sites):
            await site.stop()
        deadline = time.monotonic() + state.config.shutdown_grace_s
        while state.handler_tasks and time.monotonic() < deadline:
            await asyncio.sleep(CLOSE_POLL_S)
        left = [t for t in state.handler_tasks if not t.done()]
        for task in left:
            task.cancel()
        if left:
            log.info("cancelled %d request(s) still in flight at shutdown", len(left))
            await asyncio.wait(left, timeout=CANCEL_WAIT_S)
        await self.runner.cleanup()


async def start_gateway(
    engine: EngineClient,
    config: GatewayConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> RunningGateway:
    """Bind ``host:port`` (port 0: any free port) and serve ``engine``; returns once listening."""
    config = config or GatewayConfig()
    app = build_app(engine, config)
    http_responses = app[STATE_KEY].metrics.http_responses
    runner = GatewayRunner(app, config, count_response=lambda status: http_responses.labels(str(status)).inc(),
                           handler_cancellation=True, access_log=None,
                           shutdown_timeout=CANCEL_WAIT_S)  # close() drains first: nothing is left to wait for
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            bound_port = address[1]
            break
    return RunningGateway(runner, host, bound_port)


def curl_example(url: str, model: str, needs_api_key: bool = False) -> str:
    """A one-line curl that streams a chat completion from ``url`` (the key itself is never printed)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32,
                       "stream": True})
    auth = ' -H "Authorization: Bearer $DEEPINFER_API_KEY"' if needs_api_key else ""
    return (f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}")


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set ``stop`` while inside (no-op where the loop cannot take handlers)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def serve(
    engine: EngineClient,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    config: GatewayConfig | None = None,
    print_fn: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
) -> None:
    """Serve until ``stop`` is set, the task is cancelled, or (``handle_signals``) SIGINT/SIGTERM
    arrives. The engine is the caller's: it is neither started nor shut down here."""
    if config is None:
        config = GatewayConfig(api_key=api_key)
    elif api_key is not None:
        raise ValueError("give api_key either directly or inside config, not both")
    stop = stop or asyncio.Event()
    gateway = await start_gateway(engine, config, host=host, port=port)
    try:
        with stop_on_signals(stop) if handle_signals else contextlib.nullcontext():
            model = (config.served_model_names or (engine.model_info.name,))[0]
            print_fn(f"DeepInfer is serving {model!r} at {gateway.url} (OpenAI-compatible API under "
                     f"{gateway.url}/v1)")
            print_fn("Try:")
            print_fn(f"  {curl_example(gateway.url, model, config.api_key is not None)}")
            await stop.wait()
    finally:
        await gateway.close()
