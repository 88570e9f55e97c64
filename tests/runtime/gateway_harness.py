"""Shared helpers of the gateway tests: the tiny tokenizer, engine factories, running servers.

Tests take an *engine factory* (``() -> EngineClient``), so the same HTTP tests run against the
FakeEngine here and, once it exists, the real AsyncEngine (add a factory to ENGINE_FACTORIES).
Load this module from a test with ``load_helper("gateway_harness")`` (tests/ has no packages).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from deepinfer.engine.text.tiny_tokenizer import build_tokenizer, write_tokenizer_files
from deepinfer.engine.text.tokenizer import Tokenizer
from deepinfer.runtime.gateway import EngineClient, GatewayConfig, RunningGateway, start_gateway

HERE = Path(__file__).parent


def load_helper(name: str):
    """Import ``tests/runtime/<name>.py`` once under its own module name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fake = load_helper("gateway_fake_engine")
FakeEngine = fake.FakeEngine


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """The built-in tiny byte-level BPE with its DeepSeek-style chat template (built once)."""
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(d, build_tokenizer(4096), model_max_length=4096)
        return Tokenizer.from_dir(d)


def fake_engine(**kwargs) -> FakeEngine:
    return FakeEngine(tiny_tokenizer(), **kwargs)


@contextlib.asynccontextmanager
async def fake_engine_context() -> AsyncIterator[EngineClient]:
    yield fake_engine()


# The real engine's tests serve the built-in tiny model, written once per machine (atomically,
# keyed by the writer's fingerprint) under the temp dir rather than the user's cache.
TEST_CACHE_DIR = Path(tempfile.gettempdir()) / "deepinfer-tests"
TINY_ENGINE_OPTIONS = dict(device="cpu", max_num_seqs=32, max_model_len=2048)


@functools.cache
def tiny_model_dir() -> Path:
    from deepinfer.runtime.gateway.builtin_model import ensure_builtin_model

    return ensure_builtin_model(TEST_CACHE_DIR, show_progress=False)[0]


@contextlib.asynccontextmanager
async def tiny_engine_context(**options) -> AsyncIterator[EngineClient]:
    """The real AsyncEngine on the tiny model (CPU), shut down on exit."""
    from deepinfer.engine.api.async_engine import AsyncEngine

    engine = await AsyncEngine.start(model=str(tiny_model_dir()), served_model_name="deepinfer-tiny",
                                     **{**TINY_ENGINE_OPTIONS, **options})
    try:
        yield engine
    finally:
        await engine.shutdown()


# name -> () -> async context manager yielding a started EngineClient (shut down on exit)
EngineContext = Callable[[], contextlib.AbstractAsyncContextManager[EngineClient]]
ENGINE_FACTORIES: dict[str, EngineContext] = {"fake": fake_engine_context, "tiny": tiny_engine_context}


def num_live_requests(engine: EngineClient) -> int:
    """Requests the engine still holds (running + waiting), for leak checks on either engine."""
    stats = engine.stats()
    return stats.num_running + stats.num_waiting


@contextlib.asynccontextmanager
async def running_gateway(engine: EngineClient, config: GatewayConfig | None = None
                          ) -> AsyncIterator[RunningGateway]:
    """The gateway for ``engine`` on a free loopback port, closed afterwards."""
    gateway = await start_gateway(engine, config, host="127.0.0.1", port=0)
    try:
        yield gateway
    finally:
        await gateway.close()


class ThreadedGateway:
    """A gateway + engine on their own event loop in a thread, for synchronous clients.
    ``engine_factory`` builds the engine on that loop: a plain callable returning an engine, or
    an ``EngineContext`` (an async context manager factory, e.g. ``ENGINE_FACTORIES["tiny"]``)
    whose exit shuts the engine down."""

    def __init__(self, engine_factory: Callable[[], object], config: GatewayConfig | None = None):
        self._factory = engine_factory
        self._config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway-test-loop", daemon=True)
        self._context: contextlib.AbstractAsyncContextManager | None = None
        self.engine: EngineClient | None = None
        self.gateway: RunningGateway | None = None

    def __enter__(self) -> ThreadedGateway:
        self._thread.start()

        async def start():
            made = self._factory()
            if isinstance(made, contextlib.AbstractAsyncContextManager):
                self._context = made
                made = await made.__aenter__()
            self.engine = made
            self.gateway = await start_gateway(self.engine, self._config, host="127.0.0.1", port=0)

        try:
            asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def port(self) -> int:
        return self.gateway.port

    def call(self, fn: Callable[[], object]):
        """Run ``fn`` on the server's loop (to read engine state safely)."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def __exit__(self, *exc) -> None:
        async def stop():
            try:
                if self.gateway is not None:
                    await self.gateway.close()
            finally:
                if self._context is not None:
                    await self._context.__aexit__(None, None, None)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
