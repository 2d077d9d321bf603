"""The command line's requests: ``submit`` through the API's own admission (``admission``) and
the queue, and ``generate`` and ``resume`` through the REST API, each with a progress bar."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import Progress

from admission.body import GenerateBody, field_error
from admission.request import RequestAdmission
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from config.settings import Settings
from keys import GenerationSpec, OutputFormat, Priority, StoreKey
from workers.queue.admission import (
    FieldError,
    Limits,
    QueueFullError,
    UnknownModelError,
    check_model,
    published_limits,
)
from workers.queue.client import QueueClient
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import NotPublishedError

if TYPE_CHECKING:
    import httpx  # imported where it is used: ``submit`` needs no HTTP client

# How long ``diffcache submit`` follows a request by default (its --timeout).
SUBMIT_TIMEOUT_S = 3600.0


@dataclass(frozen=True, slots=True)
class Ask:
    """What ``diffcache submit`` was asked for; None: the served model's default."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    output_format: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    priority: Priority = Priority.INTERACTIVE
    model: str | None = None


def admitted(queue: QueueClient, requests: RequestAdmission, ask: Ask, tenant: str,
             out: str) -> GenerationSpec:
    """Check and submit ``ask`` through the API's own admission (``admission.request``):
    what the API refuses is refused here, with its message and field."""
    try:
        served = queue.served()
        check_model(ask.model, served)
        body = generate_body(ask, format_for(out, ask.output_format, served.limits.video))
        spec = requests.admit(tenant, body, served).spec
        queue.submit(spec, served)
    except FieldError as exc:
        # The API's own message, which starts with the field; submit sends no image.
        hint = "; submit sends no image: use diffcache generate --image" \
            if exc.field == "image" else ""
        raise SystemExit(f"error: refused: {exc}{hint}") from None
    except (NotPublishedError, QueueFullError, UnknownModelError) as exc:
        raise SystemExit(f"error: refused: {exc}") from None
    return spec


def generate_body(ask: Ask, output_format: str) -> GenerateBody:
    """``ask`` as the body the API's route would have read, its schema's bounds checked."""
    try:
        return GenerateBody(
            prompt=ask.prompt, negative_prompt=ask.negative_prompt, width=ask.width,
            height=ask.height, num_frames=ask.num_frames, num_inference_steps=ask.steps,
            guidance_scale=ask.guidance_scale, seed=ask.seed,
            output_format=OutputFormat(output_format), priority=ask.priority)
    except ValidationError as exc:
        raise field_error(exc.errors()[0]) from None


def submit_and_wait(settings: Settings, ask: Ask, tenant: str, out: str, console: Console,
                    timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
    client = open_redis(settings)
    # The limits the API admits under; this machine's settings where no API has said.
    queue = QueueClient(client, published_limits(client) or Limits.of(settings.api))
    try:
        spec = admitted(queue, RequestAdmission(settings.api, queue.admission), ask, tenant,
                        out)
        record = followed(queue, spec, console, timeout_s)
    finally:
        queue.close()
    if record is None:  # ``follow`` yields at least once or raises: unreachable
        raise SystemExit(f"request {spec.request_id} was never read")
    if record.state is not State.DONE or record.output_key is None:
        raise SystemExit(f"request {spec.request_id} ended {record.state}: {record.error}")
    cache = open_cache(settings, client)
    data = cache.get(StoreKey.parse(record.output_key), lookup=False)
    cache.close()
    if data is None:
        raise SystemExit(f"output of {spec.request_id} expired from the store")
    Path(out).write_bytes(data.numpy().tobytes())
    timings = ", ".join(f"{k} {v:.2f}s" for k, v in record.stage_seconds().items())
    console.print(f"wrote {out} ({len(data)} bytes); {timings}; cache hits {record.hits()}")


def followed(queue: QueueClient, spec: GenerationSpec, console: Console,
             timeout_s: float) -> RequestRecord | None:
    """Follow the request with a progress bar, woken by its record's notifications (not by
    polling it); its last record."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("queued", total=spec.num_inference_steps)
        record: RequestRecord | None = None
        try:
            for record in queue.follow(spec.tenant, spec.request_id, timeout_s):
                progress.update(task, completed=record.step,
                                description=record.state.value.lower())
        except TimeoutError as exc:
            state = record.state.value if record is not None else "unknown"
            raise SystemExit(f"gave up waiting ({exc}); the request is {state} and keeps "
                             "running") from None
        except KeyError as exc:
            raise SystemExit(f"request {spec.request_id} has no record any more") from exc
    return record


def format_for(out: str, asked: str | None, video: bool | None = None) -> str:
    """The output format ``--out`` asks for, checked before anything is submitted, so a
    request never runs only for its output to be unwritable: the directory must exist, the
    extension must be one the server writes (or ``asked`` names it, for a file without one),
    and an image model makes no MP4 (``video`` False; None when not known here)."""
    path = Path(out)
    if not path.parent.is_dir():
        raise SystemExit(f"error: {path.parent} is not a directory; create it or choose "
                         "another --out")
    written = sorted(f.value for f in OutputFormat)
    suffix = path.suffix.lower().removeprefix(".")
    if suffix and suffix not in written:
        raise SystemExit(f"error: {out} asks for {suffix}, which the server does not write; "
                         f"name the file .{', .'.join(written)}")
    if not suffix and asked is None:
        raise SystemExit(f"error: {out} has no extension; name the file "
                         f".{', .'.join(written)}, or give --output-format")
    if asked is not None and suffix and asked != suffix:
        raise SystemExit(f"error: --output-format {asked} does not match {out}: use a "
                         f".{asked} file or --output-format {suffix}")
    chosen = asked or suffix
    if video is False and chosen == OutputFormat.MP4.value:
        raise SystemExit(f"error: the served model makes images, not video: name {out} "
                         ".png or .npy")
    return chosen


def call_and_follow(api_url: str, api_key: str | None, path: str, body: Mapping[str, object],
                    out: str, console: Console, files: Mapping[str, Path] | None = None
                    ) -> None:
    """POST a request (``/v1/generate`` or ``/v1/resume``), follow its events with a progress
    bar, then fetch the result; with ``files`` (``image``, ``mask``: a path each), upload
    them first and name them. Every failure it can foresee is one line."""
    import httpx

    try:
        _call_and_follow(api_url, api_key, path, body, out, console, files or {})
    except httpx.ConnectError:
        raise SystemExit(f"error: no API at {api_url}; is `diffcache up` running?") from None
    except httpx.TimeoutException as exc:
        raise SystemExit(f"error: the API at {api_url} did not answer in time ({exc})") from None
    except httpx.HTTPError as exc:
        raise SystemExit(f"error: talking to the API at {api_url} failed: {exc}") from None


def _call_and_follow(api_url: str, api_key: str | None, path: str,
                     body: Mapping[str, object], out: str, console: Console,
                     files: Mapping[str, Path]) -> None:
    import json

    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}
    with httpx.Client(base_url=api_url, headers=headers, timeout=30) as http:
        body = {**body, **{field: _uploaded(http, field, path) for field, path in files.items()}}
        accepted = http.post(path, json=body)
        if accepted.status_code != 202:
            raise SystemExit(f"error: refused ({accepted.status_code}): {_error(accepted)}")
        request_id = accepted.json()["id"]
        status: dict[str, Any] = {}
        with Progress(console=console, transient=True) as progress, \
                http.stream("GET", f"/v1/requests/{request_id}/events", timeout=None) as events:
            task = progress.add_task("queued", total=None)
            for line in events.iter_lines():
                if line.startswith("data: ") and '"step"' in line:
                    status = json.loads(line.removeprefix("data: "))
                    progress.update(task, total=status["steps"], completed=status["step"],
                                    description=str(status["state"]).lower())
        if status.get("state") != State.DONE.value:
            raise SystemExit(f"request {request_id} ended {status.get('state')}: "
                             f"{status.get('error')}")
        data = http.get(f"/v1/requests/{request_id}/result").content
    Path(out).write_bytes(data)
    seconds = status["stage_seconds"]
    assert isinstance(seconds, dict)
    timings = ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
    console.print(f"wrote {out} ({len(data)} bytes) for request {request_id}; {timings}; "
                  f"cache hits {status['cache_hits']}")
    reuse = status.get("reuse")
    if isinstance(reuse, dict) and reuse.get("approximate"):
        console.print(f"approximate: the first {reuse['steps_reused']} steps are those of "
                      f"request {reuse['source_request_id']} (prompt similarity "
                      f"{reuse['similarity']:.3f}, seed {reuse['effective_seed']})")


def _uploaded(http: httpx.Client, field: str, image: Path) -> str:
    """The hash the API keeps ``image`` under, uploaded with ``POST /v1/images`` as the
    request's ``field`` (an image or a mask; the same pixels uploaded again are the same
    image, so nothing is kept twice)."""
    kept = http.post("/v1/images", content=image.read_bytes(), params={"kind": field})
    if kept.status_code != 201:
        raise SystemExit(f"error: --{field} {image} refused ({kept.status_code}): "
                         f"{_error(kept)}")
    return str(kept.json()["hash"])


def _error(answer: httpx.Response) -> str:
    """The message of an error body, in the native shape or OpenAI's (``/v1/images``)."""
    try:
        error = answer.json().get("error", answer.text)
    except ValueError:
        return answer.text
    return str(error.get("message", error) if isinstance(error, dict) else error)


def lora_body(text: str) -> dict[str, str | float]:
    """``--lora NAME`` or ``NAME:SCALE`` as the API's ``loras`` entry; typer.BadParameter
    naming the option for a scale that is not a number."""
    name, _, scale = text.rpartition(":") if ":" in text else (text, "", "")
    if not scale:
        return {"name": name}
    try:
        return {"name": name, "scale": float(scale)}
    except ValueError:
        raise typer.BadParameter(f"{text!r}: the scale after ':' must be a number",
                                 param_hint="--lora") from None


def step_cache_body(text: str) -> dict[str, str | float]:
    """``--step-cache POLICY`` or ``POLICY:NAME=VALUE,...`` (``first_block:threshold=0.2``)
    as the API's ``step_cache``; the API checks the policy and its parameters."""
    policy, _, given = text.partition(":")
    body: dict[str, str | float] = {"policy": policy}
    for pair in filter(None, given.split(",")):
        name, _, value = pair.partition("=")
        body[name] = _number(value, text, "--step-cache", f"the value of {name!r}")
    return body


def cfg_cache_body(text: str) -> dict[str, str | float]:
    """``--cfg-cache MODE`` or ``interval:N`` as the API's ``cfg_cache``."""
    mode, _, interval = text.partition(":")
    if not interval:
        return {"mode": mode}
    return {"mode": mode, "interval": _number(interval, text, "--cfg-cache", "the interval")}


def schedule_body(texts: list[str]) -> list[dict[str, str | float]]:
    """Each ``--schedule UNTIL_STEP:PROMPT`` as a segment of the API's ``schedule``."""
    segments: list[dict[str, str | float]] = []
    for text in texts:
        until, _, prompt = text.partition(":")
        segments.append({"until_step": _number(until, text, "--schedule", "UNTIL_STEP"),
                         "prompt": prompt})
    return segments


def _number(value: str, text: str, option: str, what: str) -> float:
    """``value`` as the number the API reads (an integer where it is one)."""
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"{text!r}: {what} must be a number",
                                 param_hint=option) from None
    return int(number) if number.is_integer() else number
