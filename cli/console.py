"""A readable console: our own lines, plus the warnings and errors of every child.

Children write everything to their own log file under ``<data_dir>/logs``. Mooncake's C++
clients log to this process's stderr (glog, at INFO), so that file descriptor is pointed at a
log file of its own, and the console writes to a copy of the terminal's descriptor.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.markup import escape

# What marks a line as a warning or error in each child's own format: glog (W/E/F and a
# date), Python logging and uvicorn (the level name), Valkey ('#' is its warning level).
_SEVERE = re.compile(r"^[WEF]\d{4} |\b(WARNING|ERROR|CRITICAL)\b|^ERROR:|^\d+:[A-Z] .* # ")
# Every Mooncake client says these while it starts or stops (its segment is not registered):
# expected, and no sign of trouble.
_BENIGN = re.compile(r"Logging before InitGoogleLogging|metadata not found|"
                     r"Failed to (retrieve|unregister) segment descriptor|"
                     r"Failed to remove location")
POLL_S = 0.5


# The sweeper's periodic passes: what each removed is worth a line in the log file, not on a
# console that an operator watches for trouble.
PERIODIC_LOGGERS = ("workers.queue.retention", "cachesvc.ttl_index", "cachesvc.output_files")


def log_handlers(terminal: IO[str], log_path: Path, fmt: str) -> list[logging.Handler]:
    """Everything to ``log_path``; to the console, all but the periodic passes' INFO lines."""
    console = logging.StreamHandler(terminal)
    console.addFilter(lambda r: r.levelno >= logging.WARNING
                      or not r.name.startswith(PERIODIC_LOGGERS))
    handlers: list[logging.Handler] = [console, logging.FileHandler(log_path)]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt))
    return handlers


def detach_native_stderr(log_path: Path) -> IO[str]:
    """Send whatever writes to fd 2 (glog in C++ extensions) to ``log_path``, and return a
    stream on the original stderr for the console."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    target = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 2)
    os.close(target)
    return terminal


class LogEcho:
    """Follows children's log files and prints their severe lines, prefixed by the child."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._files: dict[str, tuple[Path, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-echo", daemon=True)
        self._thread.start()

    def follow(self, name: str, path: Path) -> None:
        """Echo what ``path`` gets from now on (start-up chatter is in the file)."""
        size = path.stat().st_size if path.exists() else 0
        with self._lock:
            self._files[name] = (path, size)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                files = dict(self._files)
            for name, (path, offset) in files.items():
                read_to = self._echo_new(name, path, offset)
                with self._lock:
                    self._files[name] = (path, read_to)

    def _echo_new(self, name: str, path: Path, offset: int) -> int:
        try:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        complete, newline, _ = chunk.rpartition(b"\n")
        for line in complete.decode(errors="replace").splitlines():
            if _SEVERE.search(line) and not _BENIGN.search(line):
                self._console.print(f"[yellow]{escape(name)}[/yellow] {escape(line)}",
                                    highlight=False)
        return offset + len(complete) + len(newline)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
