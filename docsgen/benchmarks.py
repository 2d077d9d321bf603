"""The documentation's benchmarks page, rendered from data: each bench run with ``--record``
appends its final JSON line, with the date, commit and machine, to
``bench/results/<bench>.jsonl``. Per bench the page shows how to run it, its latest figures and
their machine, every recorded run, and a plot of each headline figure over the runs."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAMP = ("date", "commit", "machine", "bench")
BENCHES = Path(__file__).parents[1] / "bench"  # what ``record`` adds, and the bench's name


def runs_of(path: Path) -> list[dict[str, Any]]:
    """The recorded runs in ``path``, oldest first (a malformed line is skipped)."""
    runs = []
    for line in path.read_text().splitlines():
        try:
            run = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(run, dict):
            runs.append(run)
    return runs


def headline(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The figures of a bench worth a plot: the numbers its latest run reports at top level."""
    latest = runs[-1]
    return [k for k, v in latest.items()
            if k not in STAMP and isinstance(v, int | float) and not isinstance(v, bool)]


def plot(runs: Sequence[dict[str, Any]], figure: str, width: int = 480,
         height: int = 160) -> str:
    """An SVG line of ``figure`` over ``runs`` (a point per run that reports it)."""
    points = [(i, float(r[figure])) for i, r in enumerate(runs)
              if isinstance(r.get(figure), int | float)]
    pad = 28
    low, high = min(v for _, v in points), max(v for _, v in points)
    span = (high - low) or 1.0
    steps = max(len(runs) - 1, 1)

    def xy(i: int, v: float) -> str:
        x = pad + (width - 2 * pad) * i / steps
        y = height - pad - (height - 2 * pad) * (v - low) / span
        return f"{x:.1f},{y:.1f}"

    line = " ".join(xy(i, v) for i, v in points)
    dots = "".join(f'<circle cx="{xy(i, v).split(",")[0]}" cy="{xy(i, v).split(",")[1]}" '
                   f'r="3"><title>{runs[i]["date"]}: {v:g}</title></circle>'
                   for i, v in points)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="{figure} over recorded runs">'
            f'<text x="{pad}" y="16" font-size="12">{figure}: {low:g} to {high:g}</text>'
            f'<polyline fill="none" stroke="currentColor" stroke-width="2" points="{line}"/>'
            f"{dots}</svg>")


def page(results: Path) -> tuple[str, dict[str, str]]:
    """The page's Markdown, and the plots it shows (file name: SVG)."""
    lines = ["# Benchmarks", "",
             "Every bench is `python -m bench.<name>`: it prints a table, then one JSON line of "
             "the figures its issue named, each a ratio against a baseline measured in the "
             "same run where it compares. With `--record` it also appends that line, with the "
             "date, commit and machine, to `bench/results/<name>.jsonl`; this page is rendered "
             "from those files. Figures depend on the machine: compare runs of one machine.",
             ""]
    plots: dict[str, str] = {}
    for path in sorted(results.glob("*.jsonl")):
        runs = runs_of(path)
        if not runs:
            continue
        name = path.stem
        latest = runs[-1]
        lines += [f"## {name}", "", _about(name), "",
                  f"Run it: `python -m bench.{name}`. Latest: {latest.get('date', '?')}, "
                  f"commit `{latest.get('commit', '?')}`, {latest.get('machine', '?')}.", "",
                  "| figure | latest |", "|---|---|"]
        lines += [f"| `{k}` | {_value(v)} |" for k, v in latest.items() if k not in STAMP]
        lines += ["", f"{len(runs)} recorded run(s):", "",
                  "| date | commit | machine | " + " | ".join(headline(runs)) + " |",
                  "|---" * (3 + len(headline(runs))) + "|"]
        for run in runs:
            lines.append(f"| {run.get('date', '?')} | `{run.get('commit', '?')}` | "
                         f"{run.get('machine', '?')} | "
                         + " | ".join(_value(run.get(k, "")) for k in headline(runs)) + " |")
        lines.append("")
        for figure in headline(runs):
            file = f"plots/{name}-{figure}.svg"
            plots[file] = plot(runs, figure)
            lines.append(f"![{figure}]({file})")
        lines.append("")
    return "\n".join(lines) + "\n", plots


def _about(name: str) -> str:
    """The first paragraph of the bench module's docstring (read, not imported)."""
    source = BENCHES / f"{name}.py"
    if not source.exists():
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _value(v: Any) -> str:
    if isinstance(v, dict | list):
        return f"`{json.dumps(v)}`"
    return str(v)
