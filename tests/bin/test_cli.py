import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer.bin.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.bin", *args], capture_output=True, text=True, timeout=timeout
    )


def test_version_prints_package_version():
    import deepinfer

    out = run_cli("version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"deepinfer {deepinfer.__version__}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(command):
    out = run_cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: deepinfer" in out.stdout


def test_unknown_subcommand_is_a_usage_error():
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr


def test_every_package_directory_is_listed_in_pyproject():
    """A sub-package missing from pyproject would vanish from a non-editable install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = {"tests", ".venv", ".git", "build"}
    found = {"deepinfer"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in skip or rel.parts[0].startswith(".")):
            continue
        if rel.parts:
            found.add("deepinfer." + ".".join(rel.parts))
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"
