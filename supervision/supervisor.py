"""One-for-one supervision: every child that exits is reaped, logged and started again.

Restarts back off exponentially up to a cap, and a child that stayed up long enough starts
over at the shortest delay. A child restarted too often within that window is reported as
crash-looping, with its exit status and the last lines of its log, but is never given up on,
unless it exits saying no restart can help (``EXIT_CANNOT_FIT``).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import redis

from cachesvc.redis_client import RedisClient
from cachesvc.wire import Wire, WireError
from keys.names import supervised_children
from supervision.processes import ChildProcess

log = logging.getLogger(__name__)

# A worker's exit status when its model does not fit in its device's memory: every restart
# would fail alike, so it is not restarted (its status says why).
EXIT_CANNOT_FIT = 75


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before the n-th restart in a row, and when a row is over."""

    initial_s: float = 0.25
    cap_s: float = 15.0
    # A child that ran this long since its last start counts as healthy: its next crash
    # starts a new row at ``initial_s``.
    healthy_after_s: float = 30.0
    # This many restarts in one row is a crash loop (reported, and still retried at the cap).
    crash_loop_after: int = 5

    def delay(self, in_a_row: int) -> float:
        return min(self.cap_s, self.initial_s * 2.0 ** max(0, in_a_row - 1))


@dataclass(frozen=True, slots=True)
class ChildStatus:
    """What an operator needs to know about one child, as ``/readyz`` and ``status`` show it."""

    name: str
    role: str
    pid: int | None
    alive: bool
    restarts: int
    last_exit: int | None  # the exit status (negative: killed by that signal)
    last_error: str  # the last lines of its log when it last exited
    crash_looping: bool

    def describe_exit(self) -> str:
        if self.last_exit is None:
            return "never exited"
        if self.last_exit < 0:
            return f"killed by {signal.Signals(-self.last_exit).name}"
        if self.last_exit == EXIT_CANNOT_FIT:
            return "out of device memory loading its model (not restarted)"
        return f"exited with status {self.last_exit}"


@dataclass
class _Supervised:
    child: ChildProcess
    role: str
    started_at: float = 0.0
    restarts: int = 0
    in_a_row: int = 0
    last_exit: int | None = None
    last_error: str = ""
    restart_at: float | None = None  # set while waiting out the back-off
    held: bool = False  # being stopped on purpose: not restarted


class Supervisor:
    """Children to keep running. ``tick`` is called from the thread that started them, since
    a child's parent-death signal follows the thread that forked it."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._children: list[_Supervised] = []
        self._lock = threading.Lock()

    def adopt(self, child: ChildProcess, role: str) -> None:
        """Supervise ``child``, which is already running."""
        with self._lock:
            self._children.append(_Supervised(child, role, started_at=time.monotonic()))

    def tick(self) -> None:
        """Reap exited children, and start those whose back-off is over."""
        now = time.monotonic()
        for s in self._snapshot():
            if s.held:
                continue
            if s.restart_at is None and not s.child.alive():
                self._exited(s, now)
            elif s.restart_at is not None and now >= s.restart_at:
                s.restart_at = None
                s.child.start()
                s.started_at = time.monotonic()
                log.warning("%s restarted (pid %s, restart %d)", s.child.name, s.child.pid,
                            s.restarts)

    def _exited(self, s: _Supervised, now: float) -> None:
        s.last_exit = s.child.returncode
        s.last_error = s.child.log_tail(3)
        if s.last_exit == EXIT_CANNOT_FIT:
            s.held = True
            log.error("%s (pid %s) %s. Last log lines: %s", s.child.name, s.child.pid,
                      self._status_of(s).describe_exit(), s.last_error)
            return
        if now - s.started_at >= self.backoff.healthy_after_s:
            s.in_a_row = 0
        s.in_a_row += 1
        s.restarts += 1
        delay = self.backoff.delay(s.in_a_row)
        s.restart_at = now + delay
        log.error("%s (pid %s) %s; restarting in %.2f s. Last log lines: %s", s.child.name,
                  s.child.pid, self._status_of(s).describe_exit(), delay, s.last_error)

    def status(self) -> list[ChildStatus]:
        return [self._status_of(s) for s in self._snapshot()]

    def _status_of(self, s: _Supervised) -> ChildStatus:
        return ChildStatus(s.child.name, s.role, s.child.pid, s.child.alive(), s.restarts,
                           s.last_exit, s.last_error,
                           s.in_a_row >= self.backoff.crash_loop_after)

    def stop(self, roles: Sequence[str] | None = None, timeout_s: float = 5.0) -> None:
        """Stop the children of ``roles`` (default: all) together, and restart them no more:
        SIGTERM to each, then SIGKILL to any still running after ``timeout_s``."""
        chosen = [s for s in self._snapshot() if roles is None or s.role in roles]
        for s in chosen:
            s.held = True
            s.child.terminate()
        deadline = time.monotonic() + timeout_s
        for s in chosen:
            s.child.stop(max(0.0, deadline - time.monotonic()))

    def _snapshot(self) -> list[_Supervised]:
        with self._lock:
            return list(self._children)


CHILD_STATUS: Wire[ChildStatus] = Wire("child status", ChildStatus)


def publish(client: RedisClient, statuses: Sequence[ChildStatus]) -> None:
    """Write this host's children to Redis, where the API reads them for /readyz and
    /metrics. Best effort: with Redis itself restarting, the next change writes again."""
    host = socket.gethostname()
    mapping = {f"{host}/{s.name}": CHILD_STATUS.encode(s) for s in statuses}
    try:
        # Children of an earlier run on this host that this one does not have are gone.
        known: list[bytes] = client.hkeys(supervised_children())  # type: ignore[assignment]
        gone = [f for f in known if f.decode().startswith(f"{host}/")
                and f.decode() not in mapping]
        pipe = client.pipeline(transaction=True)  # one key: MULTI on a cluster too
        if gone:
            pipe.hdel(supervised_children(), *gone)
        if mapping:
            pipe.hset(supervised_children(), mapping=mapping)  # type: ignore[arg-type]
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not publish child status (%s); will retry on the next change", exc)


def read_published(client: RedisClient) -> list[ChildStatus]:
    """Every supervised child of the cluster, as last published; unreadable entries are
    skipped with a warning (they are validated JSON, never unpickled)."""
    raw: dict[bytes, bytes] = client.hgetall(supervised_children())  # type: ignore[assignment]
    out = []
    for field, value in sorted(raw.items()):
        try:
            out.append(CHILD_STATUS.decode(value))
        except WireError as exc:
            log.warning("ignoring an unreadable child status %r (%s)", field, exc)
    return out


def as_dict(status: ChildStatus) -> dict[str, object]:
    return asdict(status)
