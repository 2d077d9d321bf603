"""Writes the generated pages at each ``mkdocs build`` (the ``gen-files`` plugin runs it):
the references, read from the live code, and the benchmarks, rendered from
``bench/results``. Nothing generated is kept in the repository."""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files
import typer

from api.metrics import METRICS
from cli.main import app as cli
from config.settings import Settings, load_settings
from docsgen.benchmarks import page as benchmarks_page
from docsgen.reference import cli_page, metrics_page, rest_page, settings_page

ROOT = Path(__file__).parents[1]


def write(name: str, text: str) -> None:
    with mkdocs_gen_files.open(name, "w") as out:
        out.write(text)


def openapi() -> dict[str, object]:
    from api.app import create_app  # builds routes and schemas; connects to nothing

    return create_app(load_settings()).openapi()


write("reference/settings.md", settings_page(Settings))
write("reference/cli.md", cli_page(typer.main.get_command(cli)))
write("reference/rest.md", rest_page(openapi()))
write("reference/metrics.md", metrics_page(METRICS))
markdown, plots = benchmarks_page(ROOT / "bench" / "results")
write("benchmarks.md", markdown)
for name, svg in plots.items():
    write(name, svg)
