"""The event loop of processes DeepInfer owns, and the rule for everything else.

``run(main())`` is for entry points we own (``deepinfer node``, benchmarks, child processes):
it creates a fresh loop — uvloop when installed and ``DEEPINFER_USE_UVLOOP`` allows — runs the
coroutine to completion and closes the loop. It refuses to run inside an already running loop.

Components never call ``run``: they are coroutines and objects that work inside whatever loop
the caller is running (uvloop or the standard one), so an embedding application keeps its loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from deepinfer import envs

T = TypeVar("T")


def is_uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def loop_factory(use_uvloop: bool | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop constructor ``run`` uses: uvloop's when wanted and installed, else asyncio's."""
    wanted = envs.get().use_uvloop if use_uvloop is None else use_uvloop
    if wanted and is_uvloop_available():
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None, debug: bool | None = None) -> T:
    """Run ``main`` in a new loop owned by this call (the process entry point's loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        main.close()
        raise RuntimeError("deepinfer.runtime.loop.run() called from a running event loop; await the coroutine instead")
    with asyncio.Runner(loop_factory=loop_factory(use_uvloop), debug=debug) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """'uvloop' or 'asyncio' for ``loop`` (default: the running loop), for logs and reports."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
