"""``diffcache up``, ``head`` and ``node``: the service as a tree of supervised processes.

A head runs Valkey, the Mooncake master, the API and the sweeper; a node runs a storage node and
stage workers against a head; ``up`` is both on one machine. Each takes its data directory's
lock, checks its fixed ports, starts its part, then keeps it running: a child that exits is
restarted with back-off. On SIGTERM the workers stop taking jobs first (denoise checkpoints),
then the API, the store and Valkey stop, so nothing made during shutdown is lost.
"""

from __future__ import annotations

import json
import logging
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import httpx
import redis
from rich.console import Console

from cachesvc.counters import CacheCounters
from cachesvc.errors import CacheError
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import REDIS_ERRORS, RedisClient, open_redis
from cachesvc.ttl_index import TtlIndex
from cachesvc.value_sweep import ValueSweeper, store_capacity
from cli.console import LogEcho
from config.settings import Settings, child_environ
from supervision.instance_lock import InstanceLock
from supervision.processes import require_free
from supervision.stack import ONE_MACHINE, EmbeddedStack, Roles, StackAddresses
from supervision.supervisor import Supervisor, publish
from workers.queue.served_model import model_card

log = logging.getLogger("diffcache")

ENDPOINTS_FILE = "endpoints.json"
TICK_S = 0.2
PUBLISH_EVERY_S = 1.0
SWEEPER_STOP_S = 10.0
WORKER_ROLES = ("worker-encode", "worker-denoise", "worker-decode")
# Stopped in this order once the workers are: readers of the store before the store.
INFRA_ORDER = (("api",), ("mooncake_client",), ("mooncake_master",), ("valkey",))


def api_url(settings: Settings) -> str:
    return f"http://{settings.api.host}:{settings.api.port}"


def role_of(child_name: str) -> str:
    """``worker-denoise-1`` -> ``worker-denoise``; infrastructure children are their role."""
    head, _, index = child_name.rpartition("-")
    return head if head.startswith("worker-") and index.isdigit() else child_name


def check_fixed_ports(settings: Settings, roles: Roles = ONE_MACHINE) -> None:
    """Fail before starting anything if a configured (non-zero) port is taken."""
    host, store = settings.bind_host, settings.store
    head = [("valkey", settings.redis.port if not settings.redis.url else 0,
             "DIFFCACHE_REDIS__PORT"),
            ("mooncake_master", store.master_port, "DIFFCACHE_STORE__MASTER_PORT"),
            ("mooncake_master", store.metadata_port, "DIFFCACHE_STORE__METADATA_PORT"),
            ("mooncake_master", store.metrics_port, "DIFFCACHE_STORE__METRICS_PORT")]
    node = [("mooncake_client", store.storage_port, "DIFFCACHE_STORE__STORAGE_PORT")]
    for component, port, setting in (head if roles.head else []) + (node if roles.node else []):
        if port:
            require_free(component, host, port, setting)
    if roles.head:
        require_free("api", settings.api.host, settings.api.port, "DIFFCACHE_API__PORT")


def join_line(addresses: StackAddresses) -> str:
    """The command that makes another machine a node of this head."""
    settings = {"DIFFCACHE_REDIS__URL": addresses.redis_url,
                "DIFFCACHE_STORE__MASTER_ADDRESS": addresses.store.master_address,
                "DIFFCACHE_STORE__METADATA_SERVER": addresses.store.metadata_server,
                "DIFFCACHE_STORE__MASTER_METRICS_URL": addresses.store.metrics_url or ""}
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items() if v) + \
        " diffcache node"


class ServiceTree:
    """The processes of one ``diffcache up``, from start to an orderly stop."""

    def __init__(self, settings: Settings, console: Console,
                 roles: Roles = ONE_MACHINE) -> None:
        self.settings = settings
        self.console = console
        self.roles = roles
        self.stack = EmbeddedStack(settings, roles)
        self.supervisor = Supervisor()
        self.stop_event = threading.Event()
        self.stopped_by = "stop"
        self._lock = InstanceLock(settings.data_dir)
        self._echo = LogEcho(console)
        self._sweeper: threading.Thread | None = None  # the head's, once it is up

    def run(self) -> None:
        """Start everything, supervise until SIGTERM or SIGINT, then stop in order."""
        self._lock.acquire(api_url(self.settings))
        try:
            check_fixed_ports(self.settings, self.roles)
            self._catch_signals()
            addresses = self.stack.start()
            resolved = self.stack.resolved(addresses)
            self._print_addresses(addresses)
            if self.roles.node:
                self._start_workers(resolved)
            if self.roles.head:
                self._write_endpoints(addresses)
                self._start_api(resolved)
            for child in self.stack.children:
                self.supervisor.adopt(child, role_of(child.name))
                self._echo.follow(child.name, child.log_path)
            client = open_redis(resolved)
            publish(client, self.supervisor.status())
            if self.roles.head and not self.roles.node:
                self.console.print(f"join a node with:\n  {join_line(addresses)}")
            self._print_model()
            self.console.print("[green]diffcache is up[/green]; Ctrl-C to stop")
            if self.roles.head:  # one sweeper per cluster
                self._sweeper = threading.Thread(target=sweep_until,
                                                 args=(self.stop_event, resolved),
                                                 name="sweeper", daemon=True)
                self._sweeper.start()
            self._supervise(client)
            self._stop_sweeper()
            self._shut_down()
        finally:
            self._stop_sweeper()
            self.stack.stop()  # whatever is left, e.g. after a start-up failure
            self._echo.close()
            (self.settings.data_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
            self._lock.release()

    def _stop_sweeper(self) -> None:
        """The sweeper reads the store and Valkey, so it ends before they do."""
        self.stop_event.set()
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is None:
            return
        sweeper.join(SWEEPER_STOP_S)
        if sweeper.is_alive():
            log.warning("the sweeper's pass outlasted %.0f s; stopping without it",
                        SWEEPER_STOP_S)

    def _supervise(self, client: RedisClient) -> None:
        """Restart what exits until asked to stop; children are (re)started from this
        thread, the one their parent-death signal is tied to."""
        next_publish = 0.0
        while not self.stop_event.wait(TICK_S):
            self.supervisor.tick()
            if time.monotonic() >= next_publish:
                publish(client, self.supervisor.status())
                next_publish = time.monotonic() + PUBLISH_EVERY_S

    def _shut_down(self) -> None:
        grace = self.settings.workers.shutdown_grace_s
        self.console.print(f"\n{self.stopped_by}: stopping workers (up to {grace:.0f} s for "
                           "jobs in hand)")
        self.supervisor.stop(WORKER_ROLES, timeout_s=grace)
        for roles in INFRA_ORDER:
            self.supervisor.stop(roles)

    def _catch_signals(self) -> None:
        # The handler only records the signal: it runs between two bytecodes of the main
        # thread, which may be inside a write to the console, and a second write there fails.
        def handler(signum: int, _frame: FrameType | None) -> None:
            self.stopped_by = signal.Signals(signum).name
            self.stop_event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def _print_addresses(self, addresses: StackAddresses) -> None:
        self.console.print(f"redis           {addresses.redis_url}")
        self.console.print(f"mooncake master {addresses.store.master_address}")
        self.console.print(f"metadata server {addresses.store.metadata_server}")
        self.console.print(f"logs            {self.settings.logs_dir} "
                           "(`diffcache logs <role>`)")

    def _print_model(self) -> None:
        """What the served model was trained on, so a first prompt asks for what it knows."""
        if not self.roles.node:
            return
        from workers.main import model_name

        card = model_card(self.settings.model_dir)
        if card.native_width:
            self.console.print(f"model           {model_name(self.settings)}, trained at "
                               f"{card.native_width}x{card.native_height} (at most "
                               f"{card.max_width}x{card.max_height}) on {card.prompts}",
                               highlight=False, markup=False)

    def _write_endpoints(self, addresses: StackAddresses) -> None:
        (self.settings.data_dir / ENDPOINTS_FILE).write_text(json.dumps({
            "redis_url": addresses.redis_url,
            "master_address": addresses.store.master_address,
            "metadata_server": addresses.store.metadata_server,
            "master_metrics_url": addresses.store.metrics_url,
            "api_url": api_url(self.settings)}))

    def _start_workers(self, settings: Settings) -> None:
        """One child per configured worker; waits until each has joined its stage."""
        import torch

        from workers.launch import (
            device_environ,
            stage_counts,
            wait_joined,
            with_worker_counts,
            worker_argv,
        )
        from workers.main import ensure_model

        # Counted without opening a device (NVML), so this process holds no CUDA context.
        gpus = torch.cuda.device_count()
        settings = with_worker_counts(settings, gpus)
        counts = stage_counts(settings)
        if any(counts.values()):
            ensure_model(settings)
        env = child_environ(settings)
        client = open_redis(settings)
        devices = device_environ(settings.model, counts, gpus,
                                 settings.workers.denoise_parallel.ranks)
        for stage, i, device in devices:
            child = self.stack.spawn(f"worker-{stage.value}-{i}", worker_argv(stage),
                                     {**env, **device})
            wait_joined(child, client, stage)
            if device:
                self.console.print(f"{stage.value:<8} worker {i} on {next(iter(device.values()))}")
        for stage, count in counts.items():
            self.console.print(f"{stage.value:<8} workers {count}")

    def _start_api(self, settings: Settings) -> None:
        child = self.stack.spawn("api", [sys.executable, "-m", "api"], child_environ(settings))
        url = api_url(settings)

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        child.wait_healthy(healthy, 60, f"See {child.log_path}")
        self.console.print(f"api             {url}")
        self.console.print(f"dashboard       {url}/dashboard")


def sweep_until(stop: threading.Event, settings: Settings) -> None:
    """Keep the cache within its memory by value (every ``cache.evict_interval_s``) and remove
    expired entries, output files and old Redis state (every ``cache.sweep_interval_s``) until
    ``stop`` is set. Every pass survives the store or Redis restarting under it."""
    from workers.queue.records import Records
    from workers.queue.retention import Retention, RetentionError
    from workers.queue.watchdog import Watchdog

    client = open_redis(settings)
    index = TtlIndex(client)
    counters = CacheCounters(client, settings.cache.stats_flush_s)
    retention = Retention(client, settings.retention)
    records = Records(client)
    watchdog = Watchdog(client, settings.workers.orphan_bound_s,
                        settings.workers.live_within_s)
    files = OutputFiles(settings.outputs_dir, settings.cache.output_ttl_s)
    kept = OutputFiles(settings.checkpoints_dir, settings.cache.checkpoint_ttl_s)
    store: MooncakeStore | None = None
    capacity = store_capacity(settings)
    next_full = time.monotonic() + settings.cache.sweep_interval_s
    while not stop.wait(settings.cache.evict_interval_s):
        full = time.monotonic() >= next_full
        if full:  # storage nodes come and go; asking the master at every pass would cost
            capacity = store_capacity(settings, capacity)
        try:
            store = store or MooncakeStore.connect(StoreEndpoints.configured(settings.store),
                                                   settings.store)
            ValueSweeper(client, store, counters, capacity, settings.cache,
                         records.ended).sweep()
            if full:
                index.sweep(store)
        except (CacheError, *REDIS_ERRORS) as exc:
            if full:  # told once a full interval, not at every eviction pass
                log.warning("cache sweep failed (%s); retrying", exc)
                if store is not None:
                    _sweep_expired(index, store)
        if not full:
            continue
        next_full = time.monotonic() + settings.cache.sweep_interval_s
        try:
            while retention.sweep().backlog and not stop.is_set():
                pass  # more finished records than one pass takes: keep up with the load
        except RetentionError as exc:
            log.warning("retention sweep failed (%s); retrying next interval", exc)
        try:
            watchdog.patrol()  # logs every rescue itself
        except redis.RedisError as exc:
            log.warning("the watchdog could not read Redis (%s); retrying next interval", exc)
        files.sweep()
        kept.sweep()
    counters.close()
    if store is not None:
        store.close()


def _sweep_expired(index: TtlIndex, store: MooncakeStore) -> None:
    """The TTL sweep on its own, when the value sweep before it failed."""
    try:
        index.sweep(store)
    except (CacheError, *REDIS_ERRORS) as exc:
        log.warning("expired entries not swept (%s); retrying next interval", exc)


def endpoints_path(data_dir: Path) -> Path:
    return data_dir / ENDPOINTS_FILE
