"""Supervised children end with their parent (runtime/lifeline.py): a real parent process runs a
``Supervisor`` with two children and is SIGKILLed; the children must exit and remove the
parent's directory within a few seconds — through the lifeline pipe alone (the portable path),
with PR_SET_PDEATHSIG too, and while a child's main thread is busy before its loop runs (a
model still loading)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import load_test_helper

procs = load_test_helper("runtime/proc_helpers")

PARENT = textwrap.dedent('''
    import asyncio, sys
    from deepinfer.runtime.supervisor import ChildSpec, Supervisor

    async def main(child, root, mode):
        sup = Supervisor([ChildSpec(f"c{i}", [sys.executable, child, root, mode]) for i in range(2)],
                         cleanup_dir=root)
        await sup.start()
        print("PIDS", sup.pid("c0"), sup.pid("c1"), flush=True)
        await asyncio.sleep(120)

    asyncio.run(main(*sys.argv[1:]))
''')

CHILD = textwrap.dedent('''
    import asyncio, os, sys, time
    from deepinfer.runtime.lifeline import ParentDied, ParentWatch

    root, mode = sys.argv[1:]
    watch = ParentWatch.from_env()
    assert watch is not None and watch.cleanup_dir == root, watch

    async def main():
        stopped = asyncio.Event()
        open(os.path.join(root, f"{os.getpid()}.ready"), "w").close()
        if mode == "loading":
            while True:  # a model load: the loop is not running, only the main thread is busy
                time.sleep(0.01)
        watch.watch(asyncio.get_running_loop(), stopped.set)
        await stopped.wait()

    try:
        watch.arm(use_pdeathsig=mode != "pipe")
        asyncio.run(main())
    except ParentDied:
        pass
    finally:
        if watch.has_parent_died:
            watch.cleanup()
''')


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pipe", "pdeathsig", "loading"])
def test_children_exit_and_remove_the_directory_when_the_parent_is_killed(tmp_path, mode):
    root = tmp_path / "owned"
    root.mkdir()
    (root / "cluster.toml").write_text("# the parent's config\n")
    parent_script, child_script = tmp_path / "parent.py", tmp_path / "child.py"
    parent_script.write_text(PARENT)
    child_script.write_text(CHILD)
    parent = subprocess.Popen([sys.executable, str(parent_script), str(child_script), str(root), mode],
                              stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = parent.stdout.readline().split()
        assert line[0] == "PIDS", line
        pids = [int(p) for p in line[1:]]
        end = time.monotonic() + 30
        while len(list(root.glob("*.ready"))) < 2:
            assert time.monotonic() < end, "children did not start"
            time.sleep(0.05)
        assert all(procs.is_running(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        took, alive, present = procs.wait_gone(pids, [root], timeout_s=5.0)
        assert not alive, f"children {alive} outlived their parent"
        assert not present, f"{present} left behind"
        print(f"{mode}: children gone and directory removed {took:.2f}s after the kill")
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids:
            if procs.is_running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_without_a_supervisor_has_no_lifeline():
    from deepinfer import envs
    from deepinfer.runtime.lifeline import ParentWatch

    assert ParentWatch.from_env(envs.load({})) is None
    watch = ParentWatch.from_env(envs.load({"DEEPINFER_PARENT_PID": str(os.getppid()),
                                            "DEEPINFER_PARENT_LIFELINE_FD": "7"}))
    assert watch is not None and watch.is_parent_alive() and watch.lifeline_fd == 7


async def test_supervisor_reports_each_exit_before_restarting():
    import asyncio

    from deepinfer.runtime.supervisor import ChildSpec, Supervisor

    exits = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = Supervisor([ChildSpec("a", sleeper)], restart_delay_s=0.05,
                     on_exit=lambda name, status: exits.append((name, status, sup.num_starts(name))))
    await sup.start()
    try:
        await sup.kill("a", signal.SIGKILL, hold=False)
        for _ in range(100):
            if sup.num_starts("a") == 2:
                break
            await asyncio.sleep(0.05)
        assert exits == [("a", -signal.SIGKILL, 1)]  # heard before the restart (1 start so far)
    finally:
        await sup.stop()
    assert exits == [("a", -signal.SIGKILL, 1)]  # a stop is no news
