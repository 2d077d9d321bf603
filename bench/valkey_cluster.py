"""A Redis Cluster of bundled Valkey servers on loopback: masters, each with replicas, created
slot by slot the way ``valkey-cli --cluster create`` does. Tests and ``bench.dispatch`` run the
service on it, and kill a master to watch a replica take over."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from cachesvc.waiting import wait_until
from supervision.processes import ChildProcess, free_port
from supervision.stack import redis_ping, valkey_binary

SLOTS = 16384
HOST = "127.0.0.1"
# How long a master may be silent before its replicas elect one of them; the failover then
# takes about this plus an election (a few hundred ms).
NODE_TIMEOUT_MS = 1000


@dataclass
class ClusterNode:
    """One Valkey server of the cluster and its process."""

    port: int
    bus_port: int
    child: ChildProcess
    node_id: str = ""

    @property
    def client(self) -> redis.Redis:
        """A plain (non-cluster) connection to this server alone."""
        return redis.Redis(HOST, self.port, socket_timeout=5)

    def command(self, *args: object) -> Any:
        """One command to this server, answered as redis-py parses it."""
        return self.client.execute_command(*args)

    def cluster_state(self) -> str:
        return str(self.command("CLUSTER INFO")["cluster_state"])

    def info(self, section: str) -> dict[str, object]:
        return self.client.info(section)


class LocalValkeyCluster:
    """``masters`` masters with ``replicas`` replicas each; every write is fsynced before its
    reply, as on the embedded single server. ``url`` names one master: a cluster client finds
    the rest from it."""

    def __init__(self, data_dir: Path, masters: int = 3, replicas: int = 1) -> None:
        self.data_dir = data_dir
        self.masters, self.replicas = masters, replicas
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.nodes[0].port}"

    @property
    def urls(self) -> list[str]:
        return [f"redis://{HOST}:{n.port}" for n in self.nodes]

    def __enter__(self) -> LocalValkeyCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        for i in range(self.masters * (1 + self.replicas)):
            self.nodes.append(self._spawn(i))
        masters = self.nodes[:self.masters]
        for node in self.nodes:
            node.node_id = node.command("CLUSTER MYID").decode()
        for i, node in enumerate(masters):
            node.command("CLUSTER ADDSLOTSRANGE", i * SLOTS // self.masters,
                         (i + 1) * SLOTS // self.masters - 1)
        seed = self.nodes[0]
        for node in self.nodes[1:]:
            node.command("CLUSTER MEET", HOST, seed.port, seed.bus_port)
        wait_until(lambda: all(len(self._known(n)) == len(self.nodes) for n in self.nodes),
                   timeout_s=30, what="every cluster node knowing every other")
        for i, node in enumerate(self.nodes[self.masters:]):
            node.command("CLUSTER REPLICATE", masters[i % self.masters].node_id)
        self.wait_healthy()

    def _spawn(self, index: int) -> ClusterNode:
        # The cluster bus listens on a port of its own, by default 10000 above the client
        # port, which may be taken or out of range: it is chosen as freely.
        port, bus = free_port(HOST), free_port(HOST)
        data = self.data_dir / f"node-{index}"
        data.mkdir(parents=True, exist_ok=True)
        child = ChildProcess(f"valkey-cluster-{index}", [
            str(valkey_binary()), "--bind", HOST, "--port", str(port), "--dir", str(data),
            "--cluster-enabled", "yes", "--cluster-port", str(bus),
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            # The masters left serve their slots while one shard fails over.
            "--cluster-require-full-coverage", "no",
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--daemonize", "no"], data / "valkey.log")
        child.start()
        url = f"redis://{HOST}:{port}"
        child.wait_healthy(lambda: redis_ping(url), 20, "See the Valkey log")
        return ClusterNode(port, bus, child)

    def _known(self, node: ClusterNode) -> list[str]:
        """The nodes ``node`` has finished its handshake with, itself included."""
        nodes: dict[str, dict[str, object]] = node.command("CLUSTER NODES")
        return [address for address, facts in nodes.items()
                if facts["connected"] and "handshake" not in str(facts["flags"])]

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Until every live node says the cluster is ok and every live replica is in sync."""
        def healthy() -> bool:
            live = [n for n in self.nodes if n.child.alive()]
            if any(n.cluster_state() != "ok" for n in live):
                return False
            roles = [n.info("replication") for n in live]
            return all(r.get("master_link_status") == "up"
                       for r in roles if r["role"] == "slave")
        wait_until(healthy, timeout_s=timeout_s, interval_s=0.1, what="the cluster healthy")

    def master_of(self, key: str) -> ClusterNode:
        """The live node that serves ``key``'s slot now."""
        live = next(n for n in self.nodes if n.child.alive())
        slot = int(live.command("CLUSTER KEYSLOT", key))
        for first, last, owner, *_ in live.command("CLUSTER SLOTS"):
            if first <= slot <= last:
                port = int(owner[1])
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot} of {key!r}")

    def kill_master_of(self, key: str, timeout_s: float = 60) -> tuple[ClusterNode, ClusterNode]:
        """SIGKILL the master that serves ``key``, and wait until one of its replicas has been
        promoted in its place and the cluster is whole again; (killed, promoted)."""
        killed = self.master_of(key)
        killed.child.kill()

        def promoted() -> ClusterNode | None:
            live = [n for n in self.nodes if n.child.alive()]
            try:
                owner = self.master_of(key)
            except (LookupError, redis.RedisError):
                return None
            return (owner if owner is not killed and owner in live
                    and owner.info("replication")["role"] == "master" else None)

        successor = wait_until(promoted, timeout_s=timeout_s, interval_s=0.1,
                               what=f"a replica promoted in place of the master on "
                                    f"port {killed.port}")
        self.wait_healthy(timeout_s)
        return killed, successor

    def stop(self) -> None:
        for node in self.nodes:
            node.child.terminate()
        for node in self.nodes:
            node.child.stop()
