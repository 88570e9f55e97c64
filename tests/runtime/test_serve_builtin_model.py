"""The built-in tiny model cache: created once, atomically, safe against two first runs at once."""

import os
import re
import threading
import time

import pytest

from deepinfer.engine.models.deepseek_v4.config import ModelConfig
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.runtime.gateway.builtin_model import (
    REQUIRED_FILES,
    STALE_TMP_AGE_S,
    TMP_PREFIX,
    builtin_model_dir,
    ensure_builtin_model,
)


def _leftovers(cache_dir):
    return sorted(p.name for p in (cache_dir / "models").glob(f"{TMP_PREFIX}*"))


@pytest.mark.timeout(120)
def test_two_first_runs_at_once_build_one_complete_model(tmp_path):
    """Both threads finish writing before either renames: exactly one rename wins, the other
    uses the winner's directory and deletes its own copy."""
    both_written = threading.Barrier(2, timeout=90)

    def write_then_wait(out):
        write_tiny_model(out)
        both_written.wait()

    results = [None, None]

    def first_run(i):
        results[i] = ensure_builtin_model(tmp_path, show_progress=False, write_model=write_then_wait)

    threads = [threading.Thread(target=first_run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=110)
    assert all(r is not None for r in results), "a first run failed"
    (path_a, created_a), (path_b, created_b) = results
    assert path_a == path_b == builtin_model_dir(tmp_path)
    assert sorted([created_a, created_b]) == [False, True]
    assert sorted(os.listdir(path_a)) == sorted(REQUIRED_FILES)
    assert ModelConfig.from_dir(path_a).vocab_size == 4096
    assert _leftovers(tmp_path) == []


def test_later_runs_reuse_it_without_writing(tmp_path):
    calls = []

    def write(out):
        calls.append(out)
        write_tiny_model(out)

    path, created = ensure_builtin_model(tmp_path, show_progress=False, write_model=write)
    assert created and len(calls) == 1
    assert re.fullmatch(r"tiny-[0-9a-f]{12}", path.name) and path.parent == tmp_path / "models"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    again, created_again = ensure_builtin_model(tmp_path, show_progress=False, write_model=write)
    assert (again, created_again) == (path, False) and len(calls) == 1
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    def crash(out):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ensure_builtin_model(tmp_path, show_progress=False, write_model=crash)
    assert not builtin_model_dir(tmp_path).exists()
    assert _leftovers(tmp_path) == []

    def incomplete(out):
        (out / "config.json").write_text("{}")

    with pytest.raises(OSError, match="left out model.safetensors"):
        ensure_builtin_model(tmp_path, show_progress=False, write_model=incomplete)
    assert not builtin_model_dir(tmp_path).exists()


def test_stale_temp_dirs_of_crashed_runs_are_removed(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    stale, fresh = models / f"{TMP_PREFIX}old", models / f"{TMP_PREFIX}busy"
    stale.mkdir()
    fresh.mkdir()  # another run may be writing it right now: left alone
    old = time.time() - STALE_TMP_AGE_S - 60
    os.utime(stale, (old, old))

    def crash(out):
        raise OSError("stop here")

    with pytest.raises(OSError):
        ensure_builtin_model(tmp_path, show_progress=False, write_model=crash)
    assert _leftovers(tmp_path) == [fresh.name]


def test_unwritable_cache_dir_says_what_to_do(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="DEEPINFER_CACHE_DIR"):
        ensure_builtin_model(blocker, show_progress=False)
