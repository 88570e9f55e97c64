"""The one output convention of every benchmark: a table on stdout, figures as flat JSON."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


class Report:
    """Collects rows for the printed table and named figures for the JSON file."""

    def __init__(self, title: str):
        self.title = title
        self.columns: list[str] = []
        self.rows: list[list[str]] = []
        self.figures: dict[str, float | int | str] = {}

    def row(self, **cells) -> None:
        for key in cells:
            if key not in self.columns:
                self.columns.append(key)
        self.rows.append([cells.get(c, "") for c in self.columns])

    def figure(self, name: str, value) -> None:
        if isinstance(value, float):
            value = round(value, 6)
        self.figures[name] = value

    def render(self) -> str:
        cols = self.columns
        rows = [[_fmt(v) for v in r] + [""] * (len(cols) - len(r)) for r in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        out = [self.title, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        if self.figures:
            out.append("")
            out += [f"{k} = {_fmt(v)}" for k, v in self.figures.items()]
        return "\n".join(out)

    def finish(self, json_path: str | None) -> None:
        print(self.render(), flush=True)
        if json_path:
            data = {"machine": f"{platform.machine()} {platform.node()}", **self.figures}
            Path(json_path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e6:
            return f"{v:.3f}"
        return f"{v:.3e}"
    return str(v)


def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"deepinfer bench {prog}", description=description)
    p.add_argument("--json", metavar="PATH", default=None, help="write the figures as a flat JSON object")
    return p
