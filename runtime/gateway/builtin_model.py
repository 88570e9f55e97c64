"""The built-in tiny model ``deepinfer serve`` uses when no ``--model`` is given.

``default_model_dir``: by default (``DEEPINFER_BUILTIN_MODEL=trained``) the trained tiny
DeepSeek-V4.1 checkpoint shipped in the package (engine/models/deepseek_v41/builtin, made by
`deepinfer train-tiny`); with ``random``, or in a tree without that checkpoint, the random tiny
V4 model below.

The random one is written once into the user cache dir (``DEEPINFER_CACHE_DIR``, default
``~/.cache/deepinfer``) under ``models/tiny-<fingerprint>``. The fingerprint hashes the package
version and the source of the code that writes the checkpoint, so a changed writer gets a fresh
directory instead of a stale one.

Creation is atomic and safe against two first runs at the same time: each builds into its own
temporary sibling directory and renames it into place; ``rename`` of a directory onto an existing
non-empty one fails, so the loser deletes its copy and uses the winner's. A reader therefore sees
either no directory or a complete one, never a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

import deepinfer
from deepinfer import envs

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-tiny-"
STALE_TMP_AGE_S = 24 * 3600  # temp dirs of crashed runs older than this are removed

WriteModel = Callable[[Path], object]


def _default_writer(out: Path) -> object:
    from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

    return write_tiny_model(out)


def fingerprint() -> str:
    """12 hex digits naming the current tiny-model writer (version + the writing code's source)."""
    from deepinfer.engine.loader import checkpoint_writer
    from deepinfer.engine.models.deepseek_v4 import tiny_model
    from deepinfer.engine.text import markup, tiny_tokenizer

    h = hashlib.sha256(deepinfer.__version__.encode())
    for module in (tiny_model, tiny_tokenizer, markup, checkpoint_writer):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:12]


BUILTIN_CHOICES = ("trained", "random")


def default_model_dir(cache_dir: str | Path | None = None, *, show_progress: bool = True) -> tuple[Path, bool, str]:
    """(directory, whether this call created it, what it is) of the model served without --model."""
    choice = envs.get().builtin_model
    if choice not in BUILTIN_CHOICES:
        raise ValueError(f"DEEPINFER_BUILTIN_MODEL={choice!r}: use 'trained' or 'random'")
    if choice == "trained":
        from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

        shipped = builtin_checkpoint()
        if shipped is not None:
            return shipped, False, "trained DeepSeek-V4.1 (Python standard library)"
        log.warning("this tree has no trained tiny checkpoint (engine/models/deepseek_v41/builtin); "
                    "serving the random tiny model")
    path, created = ensure_builtin_model(cache_dir, show_progress=show_progress)
    return path, created, "random DeepSeek-V4"


def builtin_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the built-in model lives (it may not exist yet)."""
    root = Path(cache_dir or envs.get().cache_dir)
    return root / "models" / f"tiny-{fingerprint()}"


def _remove_stale_temps(parent: Path) -> None:
    now = time.time()
    for p in parent.glob(f"{TMP_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > STALE_TMP_AGE_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def ensure_builtin_model(
    cache_dir: str | Path | None = None,
    *,
    show_progress: bool = True,
    write_model: WriteModel = _default_writer,
) -> tuple[Path, bool]:
    """(directory of the built-in tiny model, whether this call created it)."""
    target = builtin_model_dir(cache_dir)
    if target.is_dir():
        return target, False
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the model cache {parent} ({exc.strerror}); set DEEPINFER_CACHE_DIR "
                      "to a writable directory") from None
    _remove_stale_temps(parent)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent))
    try:
        with tqdm(total=2, desc="Creating the built-in tiny model", unit="step",
                  disable=not show_progress, leave=True) as bar:
            bar.set_postfix_str("weights")
            write_model(tmp)
            bar.update(1)
            bar.set_postfix_str("checking")
            _check_complete(tmp)
            bar.update(1)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            log.info("another process created %s first; using it", target)
            return target, False
        return target, True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _check_complete(model_dir: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise OSError(f"the tiny-model writer left out {', '.join(missing)} in {model_dir}")
