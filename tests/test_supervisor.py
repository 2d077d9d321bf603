"""The supervisor over real processes: a killed child is reaped and started again with
back-off, a crash loop is reported with its exit status and last log lines, and one data
directory runs one stack."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from bench.service_process import alive
from cachesvc.waiting import WaitTimeout, wait_until
from keys.names import supervised_children
from supervision.instance_lock import InstanceLock
from supervision.processes import ChildProcess, StartupError
from supervision.supervisor import Backoff, ChildStatus, Supervisor, publish, read_published
from tests.test_stack import diffcache_up

FAST = Backoff(initial_s=0.01, cap_s=0.05, healthy_after_s=60, crash_loop_after=3)


def tick_until(supervisor: Supervisor, done: Callable[[ChildStatus], bool],
               timeout_s: float = 10) -> ChildStatus:
    """Tick the supervisor until its first child's status is ``done``; that status."""
    last: list[ChildStatus] = []

    def ticked() -> ChildStatus | None:
        supervisor.tick()
        status = supervisor.status()[0]
        last[:] = [status]
        return status if done(status) else None

    try:
        return wait_until(ticked, timeout_s=timeout_s, what="the child status awaited")
    except WaitTimeout as exc:
        exc.add_note(f"last status: {last}")
        raise


def test_a_killed_child_is_reaped_and_restarted(tmp_path: Path) -> None:
    child = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                         tmp_path / "sleeper.log")
    child.start()
    supervisor = Supervisor(FAST)
    supervisor.adopt(child, "sleeper")
    first = child.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    status = tick_until(supervisor, lambda s: s.alive and s.pid != first)
    assert not alive(first)  # reaped: no zombie left behind
    assert status.restarts == 1 and status.last_exit == -signal.SIGKILL
    assert status.describe_exit() == "killed by SIGKILL" and not status.crash_looping
    supervisor.stop()
    assert not child.alive()
    supervisor.tick()  # a child stopped on purpose is not started again
    assert not child.alive()


def test_a_crash_loop_is_reported_with_its_status_and_last_words(tmp_path: Path) -> None:
    child = ChildProcess("doomed", ["sh", "-c", "echo 'cannot open the model' >&2; exit 3"],
                         tmp_path / "doomed.log")
    child.start()
    supervisor = Supervisor(FAST)
    supervisor.adopt(child, "doomed")
    status = tick_until(supervisor, lambda s: s.crash_looping)
    assert status.restarts >= FAST.crash_loop_after and status.last_exit == 3
    assert "cannot open the model" in status.last_error
    assert status.describe_exit() == "exited with status 3"
    supervisor.stop()


def test_a_failed_start_leads_with_its_error_not_the_retry_chatter(tmp_path: Path) -> None:
    script = ("echo 'E1130 12:00:00.0 1 master_client.cpp:361] Client not available'; "
              "for i in 1 2 3 4 5 6; do echo \"W1130 12:00:0$i.0 1 retry $i/20\"; done; exit 1")
    log = tmp_path / "client.log"
    log.write_text("E1130 11:00:00.0 1 an error of an earlier start\n" + "chatter\n" * 9)
    child = ChildProcess("mooncake_client", ["sh", "-c", script], log)
    child.start()
    with pytest.raises(StartupError) as failed:
        child.wait_healthy(lambda: False, 30, "See the log")
    message = str(failed.value)
    assert "exited at start-up" in message and "retry 6/20" in message
    assert message.index("Client not available") < message.index("retry 2/20")
    assert "earlier start" not in message  # the log is appended to across starts


def test_a_child_that_ignores_sigterm_is_killed_and_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    child = ChildProcess("stubborn", ["sh", "-c", "trap '' TERM; echo ready; exec sleep 600"],
                         tmp_path / "stubborn.log")
    child.start()
    wait_until(lambda: "ready" in child.log_tail(), timeout_s=10, what="the trap set")
    child.stop(timeout_s=0.5)
    assert not child.alive() and child.returncode == -signal.SIGKILL
    assert "stubborn" in caplog.text and "killed" in caplog.text


def test_back_off_doubles_up_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.25, cap_s=2.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [0.25, 0.5, 1.0, 2.0, 2.0]


def test_child_status_round_trips_through_redis(redis_client: redis.Redis) -> None:
    status = ChildStatus("worker-denoise-0", "worker-denoise", 42, False, 3, -9, "boom", True)
    publish(redis_client, [status])
    try:
        assert read_published(redis_client) == [status]
    finally:  # a crash-looping child left behind would make later readiness checks fail
        redis_client.delete(supervised_children())


def test_one_data_directory_runs_one_stack(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path)
    first.acquire("http://127.0.0.1:8123")
    with pytest.raises(StartupError, match=rf"pid {os.getpid()}, API http://127.0.0.1:8123"):
        InstanceLock(tmp_path).acquire("http://127.0.0.1:9999")
    first.release()
    InstanceLock(tmp_path).acquire("http://127.0.0.1:9999")  # free once released


@pytest.mark.slow
def test_a_second_up_on_the_same_data_dir_fails_at_once_naming_the_first(
        tmp_path: Path) -> None:
    with diffcache_up(tmp_path) as (proc, out):
        assert "is up" in out
        with diffcache_up(tmp_path) as (second, said):
            assert second.wait(30) == 1
            assert f"pid {proc.pid}" in said and "already running" in said
            assert "redis" not in said  # it started nothing
