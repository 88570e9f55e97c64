"""The training corpus: the running interpreter's standard library, read offline.

    sources      every ``*.py`` under the stdlib directory (tests included), except
                 site-packages, generated config modules, the codec tables of ``encodings/`` and
                 files over ``MAX_FILE_BYTES``; unreadable or non-UTF-8 files are skipped
    docstrings   the C modules built into the interpreter (``sys.builtin_module_names``), written
                 as Python stubs: each public function and class with its signature (when known)
                 and its docstring
    split        by file, from a seeded hash of its relative path: ``heldout_fraction`` of the
                 files are held out and halved into a calibration and a test part
    documents    a training file gives itself plus each function and method it defines
                 (dedented source, so many documents open with ``def``); held-out files only
                 themselves

The same interpreter and seed give the same documents in the same order.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 300_000
_SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "encodings"}
_SKIP_PREFIXES = ("_sysconfigdata", "config-")
SPLITS = ("train", "calibration", "test")


@dataclass(frozen=True, slots=True)
class SourceFile:
    name: str  # path relative to the stdlib directory ("<builtin>/NAME.pyi" for C modules)
    text: str


@dataclass(slots=True)
class Corpus:
    root: str
    python: str
    files: dict[str, list[SourceFile]] = field(default_factory=dict)  # split -> files

    def documents(self, split: str) -> list[str]:
        docs = []
        for f in self.files[split]:
            docs.append(f.text)
            if split == "train":
                docs.extend(function_sources(f.text))
        return docs


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[SourceFile]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts[:-1]) or rel.parts[0].startswith(_SKIP_PREFIXES) \
                or rel.name.startswith(_SKIP_PREFIXES):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def builtin_stubs() -> list[SourceFile]:
    """Docstrings of the interpreter's built-in C modules as Python stub files."""
    stubs = []
    for name in sorted(sys.builtin_module_names):
        if name.startswith("_") and name not in ("_io", "_collections", "_functools", "_operator", "_thread"):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        lines = [_docstring(module.__doc__, "")] if module.__doc__ else []
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not (inspect.isbuiltin(obj) or inspect.isclass(obj)) or not obj.__doc__:
                continue
            if inspect.isclass(obj):
                lines.append(f"class {attr}:\n{_docstring(obj.__doc__, '    ')}")
            else:
                lines.append(f"def {attr}{_signature(obj)}:\n{_docstring(obj.__doc__, '    ')}")
        if lines:
            stubs.append(SourceFile(f"<builtin>/{name}.pyi", "\n\n".join(lines) + "\n"))
    return stubs


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(*args, **kwargs)"


def _docstring(doc: str, indent: str) -> str:
    body = inspect.cleandoc(doc).replace("\\", "\\\\").replace('"""', "'''")
    return textwrap.indent(f'"""{body}\n"""', indent) + "\n"


def split_of(name: str, seed: int, heldout_fraction: float) -> str:
    """A file's split from a seeded hash of its name (stable across machines and runs)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u >= heldout_fraction:
        return "train"
    return "calibration" if u < heldout_fraction / 2 else "test"


def load_corpus(seed: int, heldout_fraction: float = 0.04, root: Path | None = None,
                max_files: int | None = None) -> Corpus:
    """The split corpus of ``root`` (default: this interpreter's stdlib); ``max_files`` keeps the
    first files of the sorted list (small corpora for tests)."""
    root = root or stdlib_root()
    files = source_files(root)[:max_files] + ([] if max_files else builtin_stubs())
    corpus = Corpus(str(root), sys.version.split()[0], {s: [] for s in SPLITS})
    for f in files:
        corpus.files["train" if f.name.startswith("<builtin>") else split_of(f.name, seed, heldout_fraction)].append(f)
    return corpus


def function_sources(text: str) -> list[str]:
    """Dedented source of every function and method defined in ``text`` (none if it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            out.append(textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


@dataclass(frozen=True, slots=True)
class Header:
    file: str
    header: str  # "def name(args):\n" (a one-line signature, top level)
    body: str  # the function's body as written


def function_headers(files: list[SourceFile], limit: int) -> list[Header]:
    """Top-level functions with a one-line signature, in file order: completion prompts."""
    found = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        lines = f.text.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or not node.end_lineno:
                continue
            first = lines[node.lineno - 1]
            if not first.startswith("def ") or not first.rstrip().endswith(":") or node.body[0].lineno == node.lineno:
                continue
            found.append(Header(f.name, first.rstrip() + "\n", "".join(lines[node.lineno : node.end_lineno])))
            if len(found) >= limit:
                return found
    return found
