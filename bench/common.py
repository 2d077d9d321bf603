"""Shared pieces of the benchmarks: an embedded stack of their own and the output format."""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cachesvc.connect import open_redis
from cachesvc.processes import ChildProcess
from cachesvc.settings import Settings, child_environ, load_settings
from cachesvc.stack import EmbeddedStack
from workers.launch import wait_joined, worker_argv
from workers.messages import Stage

console = Console(soft_wrap=True)


@contextmanager
def bench_stack(segment_mib: int) -> Iterator[Settings]:
    """A private embedded stack in a temporary directory; resolved settings to reach it."""
    with tempfile.TemporaryDirectory(prefix="diffcache-bench-") as data_dir:
        settings = load_settings(data_dir=data_dir, store={"segment_mib": segment_mib})
        stack = EmbeddedStack(settings)
        with stack as addresses:
            yield stack.resolved(addresses)


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def report(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
           result: dict[str, object]) -> None:
    """Print a readable table, then the one JSON line that the issue names."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)
    print(json.dumps(result), flush=True)


def start_workers(settings: Settings, logs: Path) -> list[ChildProcess]:
    """One worker process per stage, each joined to its consumer group."""
    client = open_redis(settings)
    children = []
    for stage in Stage:
        child = ChildProcess(f"bench-{stage.value}", worker_argv(stage),
                             logs / f"{stage.value}.log", child_environ(settings))
        child.start()
        children.append(child)
    for child, stage in zip(children, Stage, strict=True):
        wait_joined(child, client, stage)
    return children
