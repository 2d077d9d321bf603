"""Shared pieces of the benchmarks: an embedded stack of their own and the output format."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import WaitTimeout, wait_until
from config.settings import Settings, WorkerSettings, child_environ, load_settings
from keys import GenerationSpec, StoreKey
from supervision.processes import ChildProcess
from supervision.stack import EmbeddedStack
from workers.launch import (
    device_environ,
    stage_counts,
    wait_joined,
    with_worker_counts,
    worker_argv,
)
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.runtime import JobContext, Outcome, Worker
from workers.queue.schema import RequestRecord, State
from workers.queue.submit import submit
from workers.stages.media import decode_npy

# Piped to a file, rich would fit tables to 80 columns and cut their cells; a wide table reads
# better there.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
# The longest a benchmark waits for its workload: a stuck request fails the run, not hangs it.
WAIT_ALL_S = 3600.0


@contextmanager
def bench_stack(segment_mib: int, family: str = "auto",
                model: dict[str, object] | None = None,
                store: dict[str, object] | None = None,
                cache: dict[str, object] | None = None) -> Iterator[Settings]:
    """A private embedded stack in a temporary directory; resolved settings to reach it.
    ``model`` overrides model settings (size, device), ``store`` store settings, ``cache``
    cache settings. The model is the random one sized for timing (preset ``default``) unless
    ``model`` names another."""
    with tempfile.TemporaryDirectory(prefix="diffcache-bench-") as data_dir:
        settings = load_settings(data_dir=data_dir,
                                 store={"segment_mib": segment_mib, **(store or {})},
                                 model={"family": family, "preset": "default", **(model or {})},
                                 cache=cache or {})
        stack = EmbeddedStack(settings)
        with stack as addresses:
            yield stack.resolved(addresses)


@contextmanager
def model_stack(segment_mib: int = 1024, family: str = "auto",
                model: dict[str, object] | None = None,
                cache: dict[str, object] | None = None) -> Iterator[Settings]:
    """``bench_stack`` with the built-in model built in it, for benchmarks that run workers."""
    from workers.main import ensure_model

    with bench_stack(segment_mib, family, model, cache=cache) as settings:
        ensure_model(settings)
        yield settings


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


RESULTS = Path(__file__).parent / "results"  # each bench's recorded runs, one JSON line each


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A bench's argument parser: its docstring as its help, and ``--record``."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true",
                        help="append the final line, with the date, commit and machine, to "
                        "bench/results/<bench>.jsonl (the documentation's benchmarks page)")
    return parser


def report(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
           result: dict[str, object]) -> None:
    """Print a readable table, then the one JSON line that the issue names; with
    ``--record`` (``bench_parser``), append that line to the bench's results too."""
    print_table(title, columns, rows)
    print(json.dumps(result), flush=True)
    if "--record" in sys.argv[1:]:
        record(result)


def record(result: dict[str, object]) -> Path:
    """``result`` with when, at which commit and on what it ran, appended to its bench's
    results file; the file."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result['bench']}.jsonl"
    stamped = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
               **result}
    with path.open("a") as out:
        out.write(json.dumps(stamped) + "\n")
    return path


def commit() -> str:
    """The checkout's commit, marked ``-dirty`` when it has uncommitted changes."""
    top = Path(__file__).parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=top,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=top, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty.strip() else head


def machine() -> str:
    """What ran a bench, in words: the CPU and its cores, and the GPU where there is one."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        cpu = names[0].strip() if names else cpu
    words = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return words


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)


def start_workers(settings: Settings, logs: Path) -> list[ChildProcess]:
    """The worker processes ``diffcache up`` would start (one encode and one decode worker by
    default, denoise workers as ``with_worker_counts`` resolves them), each joined to its
    consumer group."""
    import torch

    client = open_redis(settings)
    gpus = torch.cuda.device_count()
    settings = with_worker_counts(settings, gpus)
    started = []
    for stage, i, device in device_environ(settings.model, stage_counts(settings), gpus,
                                           settings.workers.denoise_parallel.ranks):
        child = ChildProcess(f"bench-{stage.value}-{i}", worker_argv(stage),
                             logs / f"{stage.value}-{i}.log",
                             {**child_environ(settings), **device})
        child.start()
        started.append((child, stage))
    for child, stage in started:
        wait_joined(child, client, stage)
    return [child for child, _ in started]


@contextmanager
def workers(settings: Settings, logs: Path) -> Iterator[None]:
    """``start_workers`` for the length of a ``with`` block."""
    children = start_workers(settings, logs)
    try:
        yield
    finally:
        for child in children:
            child.stop()


def wait_all(records: Records, specs: Sequence[GenerationSpec], poll_s: float = 0.02,
             timeout_s: float = WAIT_ALL_S) -> dict[str, RequestRecord]:
    """Wait until every request is DONE; its record by request id. Exits on any failure, and
    when they are not all done within ``timeout_s``."""
    pending = {s.request_id: s for s in specs}
    done: dict[str, RequestRecord] = {}

    def all_done() -> bool:
        # One round trip of states per look, each record read whole once it has ended: the
        # bench shares the machine with what it measures.
        waiting = list(pending.values())
        states = records.states([(s.tenant, s.request_id) for s in waiting])
        for spec, state in zip(waiting, states, strict=True):
            if state is None or not state.terminal:
                continue
            record = records.get(spec.tenant, spec.request_id)
            if record is None:
                raise SystemExit(f"request {spec.request_id}: its record went after it ended")
            if record.state is not State.DONE:
                raise SystemExit(f"request {spec.request_id} ended {record.state.value}: "
                                 f"{record.error}")
            done[spec.request_id] = record
            del pending[spec.request_id]
        return not pending

    try:
        wait_until(all_done, timeout_s=timeout_s, interval_s=poll_s,
                   what=f"{len(specs)} requests done")
    except WaitTimeout as exc:
        raise SystemExit(f"{exc}; {len(pending)} still running, e.g. "
                         f"{next(iter(pending))}") from None
    return done


def serve(records: Records, cache: TensorCache, specs: Sequence[GenerationSpec]
          ) -> tuple[list[RequestRecord], list[np.ndarray]]:
    """``specs`` submitted together: their records and output frames (npy outputs), in
    order."""
    for spec in specs:
        submit(records.redis, spec)
    return collect(records, cache, specs)


def collect(records: Records, cache: TensorCache, specs: Sequence[GenerationSpec]
            ) -> tuple[list[RequestRecord], list[np.ndarray]]:
    """Once every one of ``specs`` (submitted) is done: their records and output frames (npy
    outputs), in order."""
    done = wait_all(records, specs)
    ordered = [done[s.request_id] for s in specs]
    frames = []
    for record in ordered:
        assert record.output_key is not None
        data = cache.get(StoreKey.parse(record.output_key), lookup=False)
        assert data is not None, f"output of {record.spec.request_id} is gone"
        frames.append(decode_npy(data.numpy().tobytes()))
    return ordered, frames


def seconds_to_done(record: RequestRecord) -> float:
    return record.updated_at - record.created_at


class NoOp:
    """A stage body that does no work: it only hands the job on."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def handle(self, ctx: JobContext) -> Outcome:
        following = self.stage.next
        job = ctx.job
        return Outcome(None if following is None else job.handoff(following, ()))

    def discard(self, outcome: Outcome) -> None:
        """Nothing was written."""


NOOP_READY, NOOP_GO = "bench:noop:ready", "bench:noop:go"
# A spawned worker process imports torch before it says it is ready.
NOOP_START_S = 300.0


def run_noop(stage: Stage, settings: Settings, batch: int) -> None:
    """A worker process whose stage body does nothing; it starts when the bench says go."""
    client = open_redis(settings)
    worker = Worker(NoOp(stage), client, WorkerSettings(block_ms=50, batch_size=batch))
    client.incr(NOOP_READY)
    wait_until(lambda: client.exists(NOOP_GO), timeout_s=NOOP_START_S, interval_s=0.001,
               what="the bench saying go")
    worker.run()


def start_noop_workers(settings: Settings, batch: int,
                       target: Callable[[Stage, Settings, int], None] = run_noop
                       ) -> list[BaseProcess]:
    """One no-op worker process per stage (``target`` runs in each), as in a deployment (no
    stage waits on another's GIL), each ready and waiting until ``NOOP_GO`` is set."""
    client = open_redis(settings)
    client.delete(NOOP_READY, NOOP_GO)
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=target, args=(stage, settings, batch), daemon=True)
        for stage in Stage]
    for p in procs:
        p.start()
    wait_until(lambda: int(client.get(NOOP_READY) or 0) >= len(procs), timeout_s=NOOP_START_S,
               what=f"{len(procs)} no-op workers ready")
    return procs


def stop_processes(procs: Sequence[BaseProcess]) -> None:
    for p in procs:
        p.terminate()
        p.join()

