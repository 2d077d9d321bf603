"""``diffcache`` commands. Settings are loaded here, once, and passed down to each role."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from cli import train
from cli.console import detach_native_stderr, log_handlers
from cli.up import ServiceTree, api_url, endpoints_path
from config.settings import Settings, SettingsError, load_settings
from keys import Priority
from supervision.processes import StartupError
from supervision.stack import HEAD, NODE, ONE_MACHINE, Roles

app = typer.Typer(help="Cache-centric disaggregated diffusion serving.", no_args_is_help=True)
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)
# The level is in every line, so `diffcache up` can echo each child's warnings and errors.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _settings(**overrides: object) -> Settings:
    try:
        return load_settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _discovered(settings: Settings) -> dict[str, str]:
    """The addresses a running ``diffcache up`` wrote down in the data dir, if any."""
    path = endpoints_path(settings.data_dir)
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
            "metadata_server": found["metadata_server"],
            "master_metrics_url": found.get("master_metrics_url")})})


def duration(seconds: float | None) -> str:
    """A duration as a person reads it: ``35 ms``, ``2.40 s``, an en dash for none."""
    if seconds is None:
        return "\N{EN DASH}"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


@app.callback()
def main() -> None:
    """Cache-centric disaggregated diffusion serving."""


@app.command()
def up(
    data_dir: str | None = typer.Option(None, help="where logs and Valkey's AOF live"),
    segment_mib: int | None = typer.Option(None, help="memory the storage node contributes"),
) -> None:
    """Start the whole service on embedded defaults and keep it running; Ctrl-C stops it."""
    overrides: dict[str, object] = {"data_dir": data_dir}
    if segment_mib is not None:
        overrides["store"] = {"segment_mib": segment_mib}
    _serve(_settings(**overrides), ONE_MACHINE, "up")


@app.command()
def head(
    data_dir: str | None = typer.Option(None, help="where logs and Valkey's AOF live"),
    bind_host: str | None = typer.Option(None, help="the address nodes reach this head at"),
) -> None:
    """Run a cluster's head: Valkey, the Mooncake master, the API and the sweeper. It prints
    the line that makes another machine a node."""
    _serve(_cluster_settings(data_dir, bind_host), HEAD, "head")


@app.command()
def node(
    data_dir: str | None = typer.Option(None, help="this node's logs and outputs"),
    bind_host: str | None = typer.Option(None, help="this machine's address on the cluster "
                                         "network"),
    segment_mib: int | None = typer.Option(None, help="memory this node's storage contributes"),
    stages: str = typer.Option("encode,denoise,decode", help="the stages this node runs "
                               "workers for (counts: DIFFCACHE_WORKERS__<STAGE>_WORKERS)"),
) -> None:
    """Join a head (the line it printed sets its addresses): contribute a storage node and
    stage workers, reading this machine's own model folder."""
    from workers.queue.messages import Stage

    wanted = [s.strip() for s in stages.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in Stage.__members__.values()]
    if unknown or not wanted:
        errors.print(f"[red]error:[/red] --stages: {', '.join(unknown) or 'none given'}; "
                     f"choose from {', '.join(s.value for s in Stage)}")
        raise typer.Exit(2)
    settings = _cluster_settings(data_dir, bind_host, segment_mib)
    counts = {f"{s.value}_workers": 0 for s in Stage if s.value not in wanted}
    _serve(settings.model_copy(update={
        "workers": settings.workers.model_copy(update=counts)}), NODE, "node")


def _cluster_settings(data_dir: str | None, bind_host: str | None,
                      segment_mib: int | None = None) -> Settings:
    """Settings of a head or a node: Mooncake clients advertise the bind address unless
    ``store.local_hostname`` says otherwise."""
    settings = _settings(data_dir=data_dir, bind_host=bind_host)
    store: dict[str, object] = {}
    if "local_hostname" not in settings.store.model_fields_set:
        store["local_hostname"] = settings.bind_host
    if segment_mib is not None:
        store["segment_mib"] = segment_mib
    return settings.model_copy(update={"store": settings.store.model_copy(update=store)})


def _check_family(settings: Settings) -> None:
    """Refuse a ``model.family`` the registry does not know before anything is started."""
    from workers.families import UnknownFamilyError, family_named

    if settings.model.family != "auto":
        try:
            family_named(settings.model.family)
        except UnknownFamilyError as exc:
            errors.print(f"[red]error:[/red] model.family: {exc}")
            raise typer.Exit(2) from exc


def _serve(settings: Settings, roles: Roles, command: str) -> None:
    _check_family(settings)
    log_path = settings.logs_dir / f"{command}.log"
    terminal = detach_native_stderr(log_path)
    console = Console(file=terminal, soft_wrap=True)
    logging.basicConfig(level=logging.INFO, handlers=log_handlers(terminal, log_path, LOG_FORMAT))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe
    try:
        ServiceTree(settings, console, roles).run()
    except StartupError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print("stopped")


@app.command()
def logs(
    role: str = typer.Argument(..., help="a child (worker-denoise-0, api, valkey, "
                               "mooncake_master, mooncake_client) or a role (worker-denoise)"),
    lines: int = typer.Option(50, "--lines", "-n", help="how many of the last lines"),
) -> None:
    """Print the end of a child's log file under <data_dir>/logs."""
    directory = _settings().logs_dir
    found = sorted(directory.glob(f"{role}.log")) or sorted(directory.glob(f"{role}-*.log"))
    if not found:
        known = sorted(p.stem for p in directory.glob("*.log"))
        errors.print(f"[red]error:[/red] no log for {role!r} in {directory}; known: {known}")
        raise typer.Exit(2)
    for path in found:
        console.print(f"[bold]==> {path} <==[/bold]")
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        console.print("\n".join(tail), markup=False, highlight=False)


@app.command()
def worker(stage: str = typer.Argument(..., help="encode, denoise or decode")) -> None:
    """Run one stage worker against the configured store and Redis."""
    from workers.main import run
    from workers.queue.messages import Stage

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        chosen = Stage(stage)
    except ValueError:
        errors.print(f"[red]error:[/red] stage must be one of {[s.value for s in Stage]}")
        raise typer.Exit(2) from None
    run(chosen, _client_settings())


model_app = typer.Typer(help="The built-in model.", no_args_is_help=True)
app.add_typer(model_app, name="model")
model_app.command("train")(train.train)
model_app.command("train-classifier")(train.train_classifier)


@model_app.command("init")
def model_init(
    dir: str | None = typer.Option(None, "--dir", help="default: <data_dir>/model"),
    preset: str | None = typer.Option(None, help="shapes (trained), default or test "
                                      "(random); default: shapes"),
    family: str | None = typer.Option(None, help="a registered model family; default: the "
                                      "preset's family"),
) -> None:
    """Install the trained shapes model, or build a tiny random model of a family, with
    save_pretrained."""
    from workers.families import UnknownFamilyError, family_named, family_to_build, is_built
    from workers.main import build_model

    settings = _settings(model={k: v for k, v in {"dir": dir, "preset": preset,
                                                   "family": family}.items() if v})
    _check_family(settings)
    if is_built(settings.model_dir):
        console.print(f"a model is already built in {settings.model_dir}")
        return
    try:
        chosen = family_named(family_to_build(settings.model.family, settings.model.preset))
        if settings.model.preset not in chosen.presets:
            raise UnknownFamilyError(f"model.preset {settings.model.preset!r} is not one of "
                                     f"{chosen.name}'s: {list(chosen.presets)}")
    except UnknownFamilyError as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    build_model(settings, chosen)
    console.print(f"built the {settings.model.preset} {chosen.name} model in "
                  f"{settings.model_dir}")


@app.command()
def submit(
    prompt: str,
    out: str = typer.Option(..., help="file to write the output to"),
    negative_prompt: str = "",
    seed: int = 0,
    output_format: str | None = typer.Option(None, help="mp4, png or npy; default: from the "
                                             "--out file's extension"),
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    priority: Priority = Priority.INTERACTIVE,
    model: str | None = typer.Option(None, help="refuse unless this names the served model "
                                     "(family, name or family/name)"),
    tenant: str | None = None,
    timeout: float = typer.Option(3600.0, min=0, help="seconds to wait for the output before "
                                  "giving up (the request keeps running)"),
) -> None:
    """Submit one request through the queue, admitted as the API admits it, and wait for its
    output. Unset sizes and steps are the served model's defaults."""
    from cli.client import Ask, submit_and_wait

    settings = _client_settings()
    # The store client's own logging goes to a file, not between the progress bar's lines.
    terminal = detach_native_stderr(settings.logs_dir / "cli.log")
    ask = Ask(prompt, negative_prompt, seed, output_format, width, height, num_frames, steps,
              guidance_scale, priority, model)
    submit_and_wait(settings, ask, tenant or settings.default_tenant, out,
                    Console(file=terminal), timeout)


def _api_base() -> str:
    """The API's URL: the configured host and port when a setting names either, else what
    ``diffcache up`` wrote down, else the defaults."""
    settings = _settings()
    if settings.api.model_fields_set & {"host", "port"}:
        return api_url(settings)
    return _discovered(settings).get("api_url", api_url(settings))


@app.command()
def generate(
    prompt: str | None = typer.Argument(None, help="what to make (or give --schedule)"),
    out: str = typer.Option(..., help="file to write the output to"),
    negative_prompt: str = "",
    seed: int | None = None,
    output_format: str | None = typer.Option(None, help="mp4, png or npy; default: from the "
                                             "--out file's extension"),
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    priority: str = typer.Option("interactive", help="interactive or batch"),
    reuse: str | None = typer.Option(None, help="exact or approximate: may start from a "
                                     "similar earlier request's checkpoint (and says so)"),
    step_cache: str | None = typer.Option(None, help="a step-cache policy: first_block, "
                                          "taylorseer or magcache, with parameters as "
                                          "first_block:threshold=0.2 (faster, and no longer "
                                          "the exact output)"),
    cfg_cache: str | None = typer.Option(None, help="exact (default), off, or interval:N "
                                         "(the unconditional branch computed every N steps: "
                                         "faster, approximate)"),
    schedule: list[str] = typer.Option([], help="a prompt schedule in place of PROMPT: "
                                       "UNTIL_STEP:PROMPT, one per segment, in order; the "
                                       "last ends at the request's steps"),
    lora: list[str] = typer.Option([], help="a LoRA adapter, NAME or NAME:SCALE (uploaded "
                                   "with POST /v1/adapters); repeat for several"),
    image: Path | None = typer.Option(None, exists=True, dir_okay=False, readable=True,
                                      help="start from this picture (image-to-image), "
                                      "animate it (an image-to-video model) or edit it as "
                                      "the prompt says (an editing model); uploaded, then "
                                      "referred to by its hash"),
    strength: float | None = typer.Option(None, help="image-to-image: how far it is noised, "
                                          "above 0 and at most 1 (default: the server's, "
                                          "0.6)"),
    mask: Path | None = typer.Option(None, exists=True, dir_okay=False, readable=True,
                                     help="inpainting, with --image: repaint where this "
                                     "picture is white (or fully transparent, if it has "
                                     "transparency), keep the rest; the image's size"),
    api_key: str | None = typer.Option(None, help="sent as X-API-Key"),
) -> None:
    """Generate through the REST API with a progress bar; prints cache hits and timings.

    The built-in model (preset shapes) was trained at 32x32 on one coloured circle, square or
    triangle on a plain background, as in "a small red circle on the left on a blue
    background"; other sizes and words run, with a warning. GET /v1/models says what the
    served model knows."""
    from cli.client import (
        call_and_follow,
        cfg_cache_body,
        format_for,
        lora_body,
        schedule_body,
        step_cache_body,
    )

    body = {k: v for k, v in {
        "prompt": prompt, "negative_prompt": negative_prompt, "seed": seed,
        "output_format": format_for(out, output_format), "width": width, "height": height,
        "num_frames": num_frames, "num_inference_steps": steps,
        "guidance_scale": guidance_scale, "priority": priority,
        "reuse": None if reuse is None else {"mode": reuse},
        "step_cache": None if step_cache is None else step_cache_body(step_cache),
        "cfg_cache": None if cfg_cache is None else cfg_cache_body(cfg_cache),
        "schedule": schedule_body(schedule) or None,
        "loras": [lora_body(text) for text in lora] or None,
        "strength": strength}.items() if v is not None}
    files = {field: path for field, path in (("image", image), ("mask", mask)) if path}
    call_and_follow(_api_base(), api_key, "/v1/generate", body, out, console, files)


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
    for check, ok in ready["checks"].items():
        console.print(f"{check:<16} {'ok' if ok else '[red]DOWN[/red]'}")
    for child in ready["children"]:
        health = ("[red]CRASH LOOP[/red]" if child["crash_looping"]
                  else "up" if child["alive"] else "[yellow]restarting[/yellow]")
        line = f"{child['name']:<20} {health:<12} restarts {child['restarts']}"
        if child["restarts"]:
            line += f", last {child['last_exit']}: {escape(child['last_error'][-200:])}"
        console.print(line, markup=True, highlight=False)
    for q in board["queues"]:
        lat = board["latency"][q["stage"]]
        lat = lat.get(q["priority"], lat)  # per priority class where the API reports that
        console.print(f"{q['stage']:<8} {q['priority']:<12} waiting {q['waiting']:<4} "
                      f"in flight {q['in_flight']:<4} p50 {duration(lat['p50']):>8}  "
                      f"p95 {duration(lat['p95']):>8}")
