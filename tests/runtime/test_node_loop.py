"""runtime.loop: entry points own a (uv)loop; components never force-own one."""

import asyncio

import pytest

from deepinfer.runtime import loop


def test_run_uses_uvloop_when_allowed_and_asyncio_when_not():
    async def which():
        return loop.loop_name()

    assert loop.run(which(), use_uvloop=True) == ("uvloop" if loop.is_uvloop_available() else "asyncio")
    assert loop.run(which(), use_uvloop=False) == "asyncio"


def test_run_returns_the_result_and_closes_its_loop():
    seen = {}

    async def main():
        seen["loop"] = asyncio.get_running_loop()
        await asyncio.sleep(0)
        return 42

    assert loop.run(main()) == 42
    assert seen["loop"].is_closed()


async def test_run_refuses_to_nest_inside_a_running_loop():
    async def inner():
        return 1

    coro = inner()
    with pytest.raises(RuntimeError, match="await the coroutine instead"):
        loop.run(coro)
    assert loop.loop_name() in ("asyncio", "uvloop")
