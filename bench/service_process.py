"""A ``diffcache`` command in a subprocess, as tests and benchmarks drive it: its output is
read all the time (a full pipe would stall the supervisor's console, and with it its stop),
a stop that overruns says what still runs, and none of its children outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path

from cachesvc.waiting import wait_until

DIFFCACHE = [sys.executable, "-c", "from cli.main import app; app()"]
# A child left by a killed supervisor gets SIGTERM from the kernel; this long to go by itself.
ORPHAN_GRACE_S = 30.0
# Under pytest's own 300 s timeout, so that this error, which shows the output, is the one seen.
START_TIMEOUT_S = 180.0


def diffcache_environ(**settings: str) -> dict[str, str]:
    """This process's environment without its DIFFCACHE_* variables, plus ``settings``: a
    command that sees only the settings it is given."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCACHE_")}
    return environ | settings


class ServiceStuckError(RuntimeError):
    """A start or stop that did not end in time; the message says what it was waiting for
    and what still runs."""


def children_of(pid: int) -> set[int]:
    """The pids whose parent is ``pid``."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: set[int], timeout_s: float = 10) -> None:
    """Wait until none of ``pids`` runs (an exited but unreaped child counts as gone)."""
    wait_until(lambda: not any(alive(p) for p in pids), timeout_s=timeout_s, interval_s=0.1,
               what=f"processes {sorted(pids)} gone")


def describe(pid: int) -> str:
    """``pid`` and its command line, for a message."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {' '.join(a.decode(errors='replace') for a in argv if a)[:160]}"


class ServiceProcess:
    """``diffcache <args>`` with ``environ``; its merged stdout and stderr are collected."""

    def __init__(self, environ: Mapping[str, str], *args: str) -> None:
        self.proc = subprocess.Popen([*DIFFCACHE, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env=dict(environ))
        self._lines: list[str] = []
        self._ended = False
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="service-output", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                with self._arrived:
                    self._lines.append(line)
                    self._arrived.notify_all()
        finally:  # whatever ended the reading, nobody waits for a line that cannot come
            with self._arrived:
                self._ended = True
                self._arrived.notify_all()

    def output(self) -> str:
        with self._arrived:
            return "".join(self._lines)

    def wait_for_start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The output up to the line saying it is up, or its first error (or its end)."""

        def started() -> bool:
            return self._ended or any("is up" in line or "error" in line
                                      for line in self._lines)

        with self._arrived:
            if not self._arrived.wait_for(started, timeout_s):
                raise ServiceStuckError(f"diffcache did not start within {timeout_s:.0f} s; "
                                        f"its output ends:\n{''.join(self._lines)[-3000:]}")
            return "".join(self._lines)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 90) -> int:
        """Send ``sig`` and return the exit status (see ``wait``)."""
        self.proc.send_signal(sig)
        return self.wait(timeout_s, f"after {sig.name}")

    def wait(self, timeout_s: float, since: str = "into the wait") -> int:
        """The exit status; ServiceStuckError, naming what still runs, if it has not exited
        within ``timeout_s``."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            running = "\n  ".join(describe(p) for p in sorted(children_of(self.pid))) or "none"
            raise ServiceStuckError(
                f"diffcache still runs {timeout_s:.0f} s {since}; its children still running:"
                f"\n  {running}\nits output ends:\n{self.output()[-3000:]}") from None

    def kill_tree(self) -> None:
        """SIGKILL it; its children, told by the kernel, get a grace to stop, then SIGKILL."""
        kids = children_of(self.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        try:
            wait_gone(kids, ORPHAN_GRACE_S)
        except TimeoutError:
            for pid in kids:
                with suppress(ProcessLookupError):  # it may end (and be reaped) meanwhile
                    os.kill(pid, signal.SIGKILL)
            wait_gone(kids)
