"""The command line's requests: ``submit`` straight through the queue, and ``generate`` and
``resume`` through the REST API, each with a progress bar."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from cachesvc.connect import open_cache, open_redis
from cachesvc.settings import Settings
from keys import GenerationSpec, OutputFormat, StoreKey
from workers.queue.events import RecordEvents
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import read_served
from workers.queue.submit import new_request_id, submit

# How long ``diffcache submit`` follows a request by default (its --timeout).
SUBMIT_TIMEOUT_S = 3600.0


def submit_and_wait(settings: Settings, prompt: str, negative_prompt: str, seed: int,
                    output_format: str | None, tenant: str, out: str, console: Console,
                    timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
    client = open_redis(settings)
    served = read_served(client)
    if served is None:
        raise SystemExit("error: no worker has said which model it serves yet; retry once "
                         "`diffcache up` is ready")
    chosen = OutputFormat(format_for(out, output_format, served.limits.video))
    m = served.defaults
    if chosen is OutputFormat.PNG and served.limits.video and m.num_frames != 1:
        raise SystemExit(f"error: png holds one frame and this model makes {m.num_frames}; "
                         f"name {out} .mp4 or .npy")
    spec = GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=prompt,
        negative_prompt=negative_prompt, width=m.width, height=m.height,
        num_frames=m.num_frames if served.limits.video else 1,
        num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
        seed=seed, output_format=chosen)
    submit(client, spec)
    events = RecordEvents(client)
    # Woken by the record's notifications, not by polling it.
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("queued", total=spec.num_inference_steps)
        record: RequestRecord | None = None
        try:
            for record in events.follow(tenant, spec.request_id, timeout_s):
                progress.update(task, completed=record.step,
                                description=record.state.value.lower())
        except TimeoutError as exc:
            state = record.state.value if record is not None else "unknown"
            raise SystemExit(f"gave up waiting ({exc}); the request is {state} and keeps "
                             "running") from None
        except KeyError as exc:
            raise SystemExit(f"request {spec.request_id} has no record any more") from exc
        finally:
            events.close()
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
                    out: str, console: Console) -> None:
    """POST a request (``/v1/generate`` or ``/v1/resume``), follow its events with a progress
    bar, then fetch the result. Every failure it can foresee is one line."""
    import httpx

    try:
        _call_and_follow(api_url, api_key, path, body, out, console)
    except httpx.ConnectError:
        raise SystemExit(f"error: no API at {api_url}; is `diffcache up` running?") from None
    except httpx.TimeoutException as exc:
        raise SystemExit(f"error: the API at {api_url} did not answer in time ({exc})") from None
    except httpx.HTTPError as exc:
        raise SystemExit(f"error: talking to the API at {api_url} failed: {exc}") from None


def _call_and_follow(api_url: str, api_key: str | None, path: str,
                     body: Mapping[str, object], out: str, console: Console) -> None:
    import json

    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}
    with httpx.Client(base_url=api_url, headers=headers, timeout=30) as http:
        accepted = http.post(path, json=body)
        if accepted.status_code != 202:
            raise SystemExit(f"error: refused ({accepted.status_code}): "
                             f"{accepted.json().get('error', accepted.text)}")
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
