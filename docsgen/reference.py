"""The documentation's reference pages, read from the live code at build time so they cannot
drift: every setting (from the settings models, a field's description or the comment above
it), the command line (from typer), the REST API (from the OpenAPI schema FastAPI builds) and
the metrics (from ``api.metrics.METRICS``)."""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ENV_PREFIX = "DIFFCACHE_"


def settings_page(root: type[BaseModel]) -> str:
    """Every field of ``root`` (a settings model of sections) with its type, default,
    environment variable and description."""
    lines = ["# Settings", "",
             "Every setting, read once at start-up from `DIFFCACHE_*` environment variables "
             "(a section's field is `DIFFCACHE_<SECTION>__<FIELD>`). A variable that names no "
             "setting stops the process. Generated from the settings models.", ""]
    top = [(name, field) for name, field in root.model_fields.items()
           if not _is_section(field)]
    lines += _table(root, top, "")
    for name, field in root.model_fields.items():
        if _is_section(field):
            section = field.annotation
            assert isinstance(section, type) and issubclass(section, BaseModel)
            lines += ["", f"## {name}", "", _first_line(section.__doc__), ""]
            lines += _table(section, list(section.model_fields.items()), name)
    return "\n".join(lines) + "\n"


def _is_section(field: FieldInfo) -> bool:
    kind = field.annotation
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _table(model: type[BaseModel], fields: Sequence[tuple[str, FieldInfo]],
           section: str) -> list[str]:
    comments = _comments(model)
    rows = ["| setting | type | default | variable | description |",
            "|---|---|---|---|---|"]
    for name, field in fields:
        variable = f"{ENV_PREFIX}{section.upper()}__{name.upper()}" if section else \
            f"{ENV_PREFIX}{name.upper()}"
        about = field.description or comments.get(name, "")
        rows.append(f"| `{section + '.' if section else ''}{name}` | {_type(field)} | "
                    f"{_default(field)} | `{variable}` | {_cell(about)} |")
    return rows


def _comments(model: type) -> dict[str, str]:
    """The comment lines right above each field of ``model``'s class body."""
    try:
        source = inspect.getsource(model)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    tree = ast.parse(inspect.cleandoc("\n" + source) if source[0].isspace() else source)
    out = {}
    for node in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) \
            else []:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            if above:
                out[node.target.id] = " ".join(above)
    return out


def _type(field: FieldInfo) -> str:
    kind = field.annotation
    text = getattr(kind, "__name__", None) if isinstance(kind, type) else None
    text = text or str(kind).replace("typing.", "").replace("pathlib.", "")
    pattern = next((m.pattern for m in field.metadata if hasattr(m, "pattern")), None)
    return f"`{text}`" + (f" matching `{pattern}`" if pattern else "")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{json.dumps(field.default_factory())}`"  # type: ignore[call-arg]
    value = field.default
    if hasattr(value, "value"):  # an enum
        value = value.value
    return "`None`" if value is None else f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _first_line(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ")


# Options typer adds to every application, about the shell rather than diffcache.
_SHELL = {"help", "install_completion", "show_completion"}


def cli_page(command: Any, name: str = "diffcache") -> str:
    """Every command of ``command`` (typer's command tree, a click-like one: typer carries
    its own click) with its arguments and options."""
    lines = ["# Command line", "",
             "`diffcache` and every command under it, generated from the typer application.",
             ""]
    for path, cmd in _commands(command, [name]):
        lines += [f"## `{' '.join(path)}`", "", _cell(cmd.help or ""), ""]
        params = [p for p in cmd.params if p.name not in _SHELL]
        if params:
            lines += ["| argument | help | default |", "|---|---|---|"]
            for param in params:
                shown = " / ".join(f"`{o}`" for o in param.opts) \
                    if param.param_type_name == "option" else f"`{(param.name or '').upper()}`"
                default = "" if param.default is None or callable(param.default) \
                    else f"`{param.default}`"
                helped = getattr(param, "help", "") or ""
                lines.append(f"| {shown} | {_cell(helped)} | {default} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    if hasattr(command, "commands"):  # a group
        for name in sorted(command.commands):
            yield from _commands(command.commands[name], [*path, name])


def rest_page(openapi: dict[str, Any]) -> str:
    """Every route of an OpenAPI schema, with its summary and request body."""
    lines = ["# REST API", "",
             "Every route the API serves, generated from its OpenAPI schema (also served "
             "live at `/openapi.json` and `/docs`).", "",
             "| method | path | what it does | body |", "|---|---|---|---|"]
    for path, methods in sorted(openapi.get("paths", {}).items()):
        for method, op in methods.items():
            body: dict[str, Any] = op.get("requestBody", {}).get("content", {})
            first: dict[str, Any] = next(iter(body.values()), {})
            schema: dict[str, Any] = first.get("schema", {})
            ref = schema.get("$ref", "").rpartition("/")[2] or ("form" if body else "")
            summary = (op.get("description") or "").split("\n\n")[0] or op.get("summary", "")
            lines.append(f"| {method.upper()} | `{path}` | {_cell(summary)} | {ref} |")
    return "\n".join(lines) + "\n"


def metrics_page(metrics: Sequence[Any]) -> str:
    """Every metric ``/metrics`` shows."""
    lines = ["# Metrics", "",
             "What `/metrics` shows (Prometheus text format), read from Redis at each scrape so "
             "one scrape covers the cluster. Generated from `api/metrics.py`.", "",
             "| metric | type | labels | meaning |", "|---|---|---|---|"]
    kinds = {"CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
             "HistogramMetricFamily": "histogram"}
    for m in metrics:
        suffix = "_total" if kinds[m.kind.__name__] == "counter" else ""
        lines.append(f"| `{m.name}{suffix}` | {kinds[m.kind.__name__]} | "
                     f"{', '.join(f'`{x}`' for x in m.labels)} | {_cell(m.help)} |")
    return "\n".join(lines) + "\n"
