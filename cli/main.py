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
from cachesvc.settings import Settings, SettingsError, child_environ, load_settings
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


ENDPOINTS_FILE = "endpoints.json"


def _discovered(settings: Settings) -> dict[str, str]:
    """The addresses a running ``diffcache up`` wrote down in the data dir, if any."""
    import json

    path = settings.data_dir / ENDPOINTS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _client_settings() -> Settings:
    """Settings for a command that joins a running stack: what ``diffcache up`` wrote down in
    the data dir fills in the addresses the environment leaves unset."""
    settings = _settings()
    found = _discovered(settings)
    if settings.redis.url or settings.store.master_address or not found:
        return settings
    return settings.model_copy(update={
        "redis": settings.redis.model_copy(update={"url": found["redis_url"]}),
        "store": settings.store.model_copy(update={
            "master_address": found["master_address"],
            "metadata_server": found["metadata_server"]})})


def _write_endpoints(settings: Settings, addresses: StackAddresses) -> None:
    import json

    (settings.data_dir / ENDPOINTS_FILE).write_text(json.dumps({
        "redis_url": addresses.redis_url, "master_address": addresses.store.master_address,
        "metadata_server": addresses.store.metadata_server,
        "api_url": _api_url(settings)}))


def _api_url(settings: Settings) -> str:
    return f"http://{settings.api.host}:{settings.api.port}"


def _start_api(stack: EmbeddedStack, settings: Settings) -> None:
    import sys

    import httpx

    from cachesvc.processes import require_free

    require_free("api", settings.api.host, settings.api.port, "DIFFCACHE_API__PORT")
    child = stack.spawn("api", [sys.executable, "-m", "api"], child_environ(settings))
    url = _api_url(settings)

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    child.wait_healthy(healthy, 60, f"See {child.log_path}")
    console.print(f"api             {url}")
    console.print(f"dashboard       {url}/dashboard")


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


def _start_workers(stack: EmbeddedStack, settings: Settings) -> None:
    """One child per configured worker; waits until each has joined its consumer group."""
    from cachesvc.connect import open_redis
    from workers.launch import wait_joined, worker_argv
    from workers.main import ensure_model
    from workers.messages import Stage

    counts = {Stage.ENCODE: settings.workers.encode_workers,
              Stage.DENOISE: settings.workers.denoise_workers,
              Stage.DECODE: settings.workers.decode_workers}
    if any(counts.values()):
        ensure_model(settings)
    env = child_environ(settings)
    client = open_redis(settings)
    for stage, count in counts.items():
        for i in range(count):
            wait_joined(stack.spawn(f"worker-{stage.value}-{i}", worker_argv(stage), env),
                        client, stage)
        console.print(f"{stage.value:<8} workers {count}")


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
            resolved = stack.resolved(addresses)
            _write_endpoints(settings, addresses)
            _start_workers(stack, resolved)
            _start_api(stack, resolved)
            console.print("[green]diffcache is up[/green]; Ctrl-C to stop")
            _sweep_until(stop, resolved)
        (settings.data_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
    except StartupError as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print("stopped")


@app.command()
def worker(stage: str = typer.Argument(..., help="encode, denoise or decode")) -> None:
    """Run one stage worker against the configured store and Redis."""
    from workers.main import run
    from workers.messages import Stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        chosen = Stage(stage)
    except ValueError:
        errors.print(f"[red]error:[/red] stage must be one of {[s.value for s in Stage]}")
        raise typer.Exit(2) from None
    run(chosen, _client_settings())


model_app = typer.Typer(help="The built-in model.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("init")
def model_init(
    dir: str | None = typer.Option(None, "--dir", help="default: <data_dir>/model"),
    preset: str | None = typer.Option(None, help="default or test"),
) -> None:
    """Build the tiny Wan2.1-architecture model and save it with save_pretrained."""
    from workers.families import wan

    settings = _settings(model={k: v for k, v in {"dir": dir, "preset": preset}.items() if v})
    if wan.is_built(settings.model_dir):
        console.print(f"model already built in {settings.model_dir}")
        return
    wan.build(settings.model_dir, settings.model.preset, settings.model.build_seed)
    console.print(f"built the {settings.model.preset} model in {settings.model_dir}")


@app.command()
def submit(
    prompt: str,
    out: str = typer.Option(..., help="file to write the output to"),
    negative_prompt: str = "",
    seed: int = 0,
    output_format: str = typer.Option("mp4", help="mp4, png or npy"),
    tenant: str | None = None,
) -> None:
    """Submit one request straight to the queue and wait for its output."""
    from cli.client import submit_and_wait

    settings = _client_settings()
    submit_and_wait(settings, prompt, negative_prompt, seed, output_format,
                    tenant or settings.default_tenant, out, console)


def _api_base() -> str:
    """The API's URL: what ``diffcache up`` wrote down, else the configured host and port."""
    settings = _settings()
    return _discovered(settings).get("api_url", _api_url(settings))


@app.command()
def generate(
    prompt: str,
    out: str = typer.Option(..., help="file to write the output to"),
    negative_prompt: str = "",
    seed: int | None = None,
    output_format: str = typer.Option("mp4", help="mp4, png or npy"),
    num_frames: int | None = None,
    steps: int | None = None,
    priority: str = typer.Option("interactive", help="interactive or batch"),
    api_key: str | None = typer.Option(None, help="sent as X-API-Key"),
) -> None:
    """Generate through the REST API with a progress bar; prints cache hits and timings."""
    from cli.client import call_and_follow

    body = {k: v for k, v in {
        "prompt": prompt, "negative_prompt": negative_prompt, "seed": seed,
        "output_format": output_format, "num_frames": num_frames,
        "num_inference_steps": steps, "priority": priority}.items() if v is not None}
    call_and_follow(_api_base(), api_key, "/v1/generate", body, out, console)


@app.command()
def resume(
    request_id: str,
    out: str = typer.Option(..., help="file to write the output to"),
    from_step: int | None = typer.Option(None, help="branch from this checkpoint (with edits)"),
    prompt: str | None = typer.Option(None, help="edit: the prompt for the remaining steps"),
    negative_prompt: str | None = None,
    guidance_scale: float | None = None,
    api_key: str | None = typer.Option(None, help="sent as X-API-Key"),
) -> None:
    """Resume a preempted, cancelled or failed request; with edits, branch a new one."""
    from cli.client import call_and_follow

    overrides = {k: v for k, v in {"prompt": prompt, "negative_prompt": negative_prompt,
                                   "guidance_scale": guidance_scale}.items() if v is not None}
    body: dict[str, object] = {"request_id": request_id}
    if overrides:
        body["overrides"] = overrides
    if from_step is not None:
        body["from_step"] = from_step
    call_and_follow(_api_base(), api_key, "/v1/resume", body, out, console)


@app.command()
def preempt(
    request_id: str,
    park: bool = typer.Option(False, help="wait for `diffcache resume` instead of re-queueing"),
    api_key: str | None = typer.Option(None, help="sent as X-API-Key"),
) -> None:
    """Checkpoint a denoising request and take it off its worker."""
    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}
    answer = httpx.post(f"{_api_base()}/v1/requests/{request_id}/preempt", headers=headers,
                        json={"mode": "park" if park else "requeue"}, timeout=10)
    if answer.status_code != 202:
        errors.print(f"[red]error:[/red] {answer.json()['error']}")
        raise typer.Exit(1)
    console.print(f"request {request_id}: {answer.json()['state']}, preemption asked")


@app.command()
def status(api_key: str | None = typer.Option(None, help="sent as X-API-Key")) -> None:
    """Readiness, queues and stage latency of a running service."""
    import httpx

    url = _api_base()
    headers = {"X-API-Key": api_key} if api_key else {}
    try:
        ready = httpx.get(f"{url}/readyz", headers=headers, timeout=5).json()
        board = httpx.get(f"{url}/v1/dashboard", headers=headers, timeout=5).json()
    except httpx.HTTPError as exc:
        errors.print(f"[red]error:[/red] no API at {url} ({exc}); is `diffcache up` running?")
        raise typer.Exit(1) from exc
    for check, ok in ready.items():
        console.print(f"{check:<16} {'ok' if ok else '[red]DOWN[/red]'}")
    for q in board["queues"]:
        lat = board["latency"][q["stage"]]
        console.print(f"{q['stage']:<8} {q['priority']:<12} waiting {q['waiting']:<4} "
                      f"in flight {q['in_flight']:<4} p50 {lat['p50']} s  p95 {lat['p95']} s")
