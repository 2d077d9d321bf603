"""Child processes that die with their parent: start, health-wait and stop.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the supervisor, which
stops children in order) and asks the kernel to SIGTERM it if the supervisor dies, so even a
``kill -9`` of the supervisor leaves no orphan.
"""

from __future__ import annotations

import ctypes
import logging
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
# An error line in glog (E/F and a date) or Python logging format.
_ERROR_LINE = re.compile(r"^[EF]\d{4} |\b(ERROR|CRITICAL)\b")

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A component could not start; the message says what is wrong and what to do."""

    def __init__(self, component: str, problem: str, remedy: str) -> None:
        super().__init__(f"{component}: {problem}. {remedy}")
        self.component = component


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def require_free(component: str, host: str, port: int, setting: str) -> int:
    """``port`` if it can be bound (a fresh free one for 0), else a StartupError."""
    if port == 0:
        return free_port(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers themselves bind: a port whose last connections linger in TIME_WAIT
        # after a restart is free, one that something listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise StartupError(component, f"port {port} on {host} is in use",
                               f"Stop what holds it, or set {setting}=0 to pick a free port"
                               ) from None
    return port


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class ChildProcess:
    """One supervised child whose output goes to ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._env = dict(env) if env is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this start's lines begin: the log is appended to
        self._terminated_at: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._terminated_at = None
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # preexec_fn runs only a prctl between fork and exec, which takes no lock.
                # PDEATHSIG follows the forking *thread*: children are started from the
                # supervisor's main thread, which lives as long as the supervisor.
                start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509
                env=self._env)

    def alive(self) -> bool:
        """Whether it runs; asking reaps it once it has exited, so no zombie is left."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: the signal that killed it)."""
        return None if self._proc is None else self._proc.poll()

    def terminate(self) -> None:
        """SIGTERM without waiting: ``stop`` waits for it."""
        if self.alive():
            assert self._proc is not None
            self._proc.terminate()
            self._terminated_at = time.monotonic()

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self._log_lines()[-lines:])

    def _log_lines(self, since: int = 0) -> list[str]:
        try:
            with self.log_path.open("rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return []

    def _start_failure(self, problem: str, remedy: str) -> StartupError:
        # The last error of this start leads: a retry loop's chatter can bury the reason.
        recent = self._log_lines(since=self._log_start)[-200:]
        errors = [line for line in recent[:-5] if _ERROR_LINE.search(line)]
        return StartupError(self.name, f"{problem} ({' | '.join(errors[-1:] + recent[-5:])})",
                            remedy)

    def wait_healthy(self, check: Callable[[], bool], timeout_s: float,
                     remedy: str) -> None:
        """Poll ``check`` until it passes; StartupError if the child exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self._start_failure("exited at start-up", remedy)
            if check():
                return
            time.sleep(0.05)
        raise self._start_failure(f"not healthy after {timeout_s:.0f} s", remedy)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
        if self._proc is None or self._proc.poll() is not None:
            return
        # Sent already by ``terminate`` when a group stops together; the time counts from then.
        if self._terminated_at is None:
            self._terminated_at = time.monotonic()
        self._proc.terminate()  # again, if ``terminate`` sent it already: harmless
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %s) still ran %.1f s after SIGTERM; killed", self.name,
                        self._proc.pid, time.monotonic() - self._terminated_at)
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
