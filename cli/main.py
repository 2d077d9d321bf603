"""``diffcache`` commands. Settings are loaded here, once, and passed down to each role."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import typer
from rich.console import Console

from cachesvc.errors import CacheError
from cachesvc.mooncake_store import MooncakeStore
from cachesvc.processes import StartupError
from cachesvc.settings import Settings, SettingsError, load_settings
from cachesvc.stack import EmbeddedStack, StackAddresses
from cachesvc.ttl_index import TtlIndex

app = typer.Typer(help="Cache-centric disaggregated diffusion serving.", no_args_is_help=True)
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("diffcache")


def _settings(**overrides: object) -> Settings:
    try:
        return load_settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _print_addresses(addresses: StackAddresses) -> None:
    console.print(f"redis           {addresses.redis_url}")
    console.print(f"mooncake master {addresses.store.master_address}")
    console.print(f"metadata server {addresses.store.metadata_server}")


def _wait_for_signal(stop: threading.Event) -> None:
    def handler(signum: int, _frame: FrameType | None) -> None:
        console.print(f"\n{signal.Signals(signum).name}: stopping")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _sweep_until(stop: threading.Event, settings: Settings) -> None:
    """Remove expired TTL'd entries that nobody reads, until ``stop`` is set."""
    from cachesvc.connect import open_redis, store_endpoints

    store = MooncakeStore.connect(store_endpoints(settings), settings.store)
    index = TtlIndex(open_redis(settings))
    try:
        while not stop.wait(settings.cache.sweep_interval_s):
            try:
                index.sweep(store)
            except CacheError:
                log.warning("TTL sweep failed; retrying next interval", exc_info=True)
    finally:
        store.close()


@app.callback()
def main() -> None:
    """Cache-centric disaggregated diffusion serving."""


@app.command()
def up(
    data_dir: str | None = typer.Option(None, help="where logs and Valkey's AOF live"),
    segment_mib: int | None = typer.Option(None, help="memory the storage node contributes"),
) -> None:
    """Start the whole service on embedded defaults; Ctrl-C stops everything."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    overrides: dict[str, object] = {"data_dir": data_dir}
    if segment_mib is not None:
        overrides["store"] = {"segment_mib": segment_mib}
    settings = _settings(**overrides)
    stop = threading.Event()
    _wait_for_signal(stop)
    stack = EmbeddedStack(settings)
    try:
        with stack as addresses:
            _print_addresses(addresses)
            console.print("[green]diffcache is up[/green]; Ctrl-C to stop")
            _sweep_until(stop, stack.resolved(addresses))
    except StartupError as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print("stopped")
