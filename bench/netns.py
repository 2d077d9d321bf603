"""Machines for the multi-host test and ``bench.cluster``: Linux network namespaces joined by
veth pairs to a bridge made for the run. Each has an address from 198.51.100.0/24 that exists
only inside it (the bridge has none, so nothing routes there) and a hostname of its own; a head
and nodes run on them as on real machines, and everything is removed on exit."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SUBNET = "198.51.100"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2's `ip` and util-linux's `unshare` are needed"
    probe = f"dcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str

    def argv(self, command: list[str], cpus: str | None = None) -> list[str]:
        """``command`` run on this machine: in its namespace, under its own hostname, on
        ``cpus`` only if given (a machine of that many cores)."""
        pinned = ["taskset", "-c", cpus, *command] if cpus else command
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *pinned]

    def spawn(self, command: list[str], env: Mapping[str, str], log: Path,
              stdin: int | None = None, cpus: str | None = None) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(self.argv(command, cpus), env=dict(env), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=stdin,
                                    start_new_session=True)

    def sent_bytes(self) -> int:
        """Bytes this machine has sent over its network interface."""
        shown = subprocess.run(["ip", "-n", self.namespace, "-j", "-s", "link", "show", "eth0"],
                               capture_output=True, text=True, check=True).stdout
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])

    def kill_everything(self) -> None:
        """The machine is gone: every process in its namespace dies at once.

        Everything is frozen before anything is killed, so no supervisor sees a child die and
        starts another in the moment between; the sweep repeats until the namespace is empty
        (a process that forked while the list was read is caught by the next one)."""
        while pids := self._pids():
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)

    def _pids(self) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True,
                                text=True, check=False).stdout.split()
        return [int(pid) for pid in listed]


@contextmanager
def network(names: list[str]) -> Iterator[dict[str, Host]]:
    """One machine per name, the first at .1; everything is removed on exit, also on failure."""
    tag = uuid.uuid4().hex[:5]
    bridge = f"dcbr{tag}"
    hosts = {name: Host(name, f"dc{tag}{i}", f"{SUBNET}.{i + 1}")
             for i, name in enumerate(names)}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts.values()):
            outer, inner = f"dc{tag}h{i}", f"dc{tag}n{i}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", inner, "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
        yield hosts
    finally:
        for i, host in enumerate(hosts.values()):
            host.kill_everything()
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True,
                           check=False)
            # The namespace may outlive its name for a while (the kernel frees it lazily):
            # deleting our end of the pair removes both ends now.
            subprocess.run(["ip", "link", "del", f"dc{tag}h{i}"], capture_output=True,
                           check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


class Driver:
    """A Python process on one machine that runs the test's calls there (``cluster_driver``),
    one JSON line in, one out: the test itself stays in the root namespace."""

    def __init__(self, host: Host, api_url: str, env: Mapping[str, str], log: Path) -> None:
        self._proc = host.spawn([sys.executable, "-m", "bench.cluster_driver", api_url], env,
                                log, stdin=subprocess.PIPE)
        self._log = log
        self._out = Path(f"{log}.out")

    def call(self, op: str, **args: Any) -> Any:
        stdin: IO[bytes] | None = self._proc.stdin
        assert stdin is not None
        self._out.unlink(missing_ok=True)
        stdin.write(json.dumps({"op": op, "args": args, "reply": str(self._out)}).encode() +
                    b"\n")
        stdin.flush()
        from cachesvc.waiting import wait_until

        wait_until(lambda: self._out.exists() or self._proc.poll() is not None,
                   timeout_s=300, interval_s=0.01, what=f"the driver's answer to {op}")
        if not self._out.exists():
            raise RuntimeError(f"the driver exited; see {self._log}")
        reply = json.loads(self._out.read_text())
        if "error" in reply:
            raise RuntimeError(f"{op}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(10)


DIFFCACHE = [sys.executable, "-m", "cli"]
PASSWORD = "netns-cluster-password"


def base_environ(**settings: str) -> dict[str, str]:
    """This process's environment without its DIFFCACHE_* settings, plus ``settings``."""
    from config.settings import ENV_PREFIX

    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    return {**env, "DIFFCACHE_REDIS__PASSWORD": PASSWORD, **settings}


def _says(log: Path, text: str) -> bool:
    return text in log.read_text(errors="replace")


def join_settings(head_log: Path) -> dict[str, str]:
    """The settings of the one line ``diffcache head`` prints for a node to join."""
    from cachesvc.waiting import wait_until

    def printed() -> str | None:
        lines = head_log.read_text(errors="replace").splitlines() if head_log.exists() else []
        return next((ln for ln in lines if ln.strip().endswith("diffcache node")), None)

    line = wait_until(printed, timeout_s=120, interval_s=0.1, what="the head's join line")
    return dict(word.split("=", 1) for word in shlex.split(line)[:-2])


@dataclass(frozen=True)
class NodeSpec:
    stages: str = "encode,denoise,decode"
    cpus: str | None = None
    segment_mib: int = 64


def start_cluster(hosts: Mapping[str, Host], nodes: Mapping[str, NodeSpec], model_dir: Path,
                  tmp: Path, api_port: int, **settings: str) -> Driver:
    """``diffcache head`` on the first host, ``diffcache node`` on the ones ``nodes`` names
    (each with its own copy of ``model_dir``), and a driver on the head's machine once its
    /readyz answers."""
    from cachesvc.waiting import wait_until

    head = next(iter(hosts.values()))
    head.spawn([*DIFFCACHE, "head", "--data-dir", str(tmp / "head"), "--bind-host",
                head.address],
               base_environ(DIFFCACHE_API__HOST=head.address,
                            DIFFCACHE_API__PORT=str(api_port), **settings), tmp / "head.out")
    joined = join_settings(tmp / "head.out")
    for name, node in nodes.items():
        host = hosts[name]
        # Each machine reads its own copy of the model: nothing is shared on disk.
        model = shutil.copytree(model_dir, tmp / name / "model", dirs_exist_ok=True)
        host.spawn([*DIFFCACHE, "node", "--data-dir", str(tmp / name), "--bind-host",
                    host.address, "--segment-mib", str(node.segment_mib), "--stages",
                    node.stages],
                   base_environ(DIFFCACHE_MODEL__DIR=str(model), **joined, **settings),
                   tmp / f"{name}.out", cpus=node.cpus)
    for name in nodes:
        wait_until(functools.partial(_says, tmp / f"{name}.out", "diffcache is up"),
                   timeout_s=300, interval_s=0.2, what=f"node {name} up")
    driver = Driver(head, f"http://{head.address}:{api_port}", base_environ(**joined),
                    tmp / "driver.log")
    wait_until(lambda: driver.call("ready"), timeout_s=60, interval_s=0.2,
               what="the head's /readyz")
    return driver
