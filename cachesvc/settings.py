"""The one settings object of every diffcache process, read once from the environment.

Variables are ``DIFFCACHE_<FIELD>`` and ``DIFFCACHE_<SECTION>__<FIELD>``. A variable with the
prefix that names no setting is an error at start-up, so a misspelling never silently falls back
to a default. Nothing else in the tree reads the environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "DIFFCACHE_"
_NESTED = "__"


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the variable or field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreSettings(_Section):
    """Mooncake Store: an external master, or the embedded one when ``master_address`` is unset."""

    master_address: str | None = Field(None, description="host:port of an external master")
    metadata_server: str | None = Field(None, description="http://host:port/metadata")
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    connect_timeout_s: float = Field(3.0, gt=0)
    # Embedded master and storage node; 0 picks a free port.
    master_port: int = Field(0, ge=0, le=65535)
    metadata_port: int = Field(0, ge=0, le=65535)
    metrics_port: int = Field(0, ge=0, le=65535)
    storage_port: int = Field(0, ge=0, le=65535)
    segment_mib: int = Field(1024, ge=16, description="memory the storage node contributes")
    # A reader's lease blocks removal and eviction of the entry it reads for this long.
    lease_ttl_ms: int = Field(2000, ge=100)
    buffer_slab_mib: int = Field(64, ge=1, description="size of one registered buffer")
    buffer_slabs: int = Field(4, ge=1, description="registered buffers kept per process")


class RedisSettings(_Section):
    """Redis or Valkey for streams and records; the embedded Valkey when ``url`` is unset."""

    url: str | None = Field(None, description="redis://host:port/db of an external server")
    port: int = Field(0, ge=0, le=65535, description="port of the embedded Valkey; 0 = free")


class CacheSettings(_Section):
    """Per-kind lifetimes and the cross-process single-flight protocol."""

    checkpoint_ttl_s: float = Field(3600.0, gt=0)
    cfg_ttl_s: float = Field(600.0, gt=0)
    output_ttl_s: float = Field(86400.0, gt=0)
    latents_ttl_s: float = Field(3600.0, gt=0, description="safety net if never consumed")
    single_flight_lease_s: float = Field(120.0, gt=0)
    single_flight_wait_s: float = Field(60.0, gt=0)
    stats_flush_s: float = Field(1.0, gt=0)
    sweep_interval_s: float = Field(30.0, gt=0)


class ModelSettings(_Section):
    """The model every worker loads: a local folder, built on first start if it is missing."""

    family: Literal["wan"] = "wan"
    dir: Path | None = Field(None, description="default: <data_dir>/model")
    preset: Literal["default", "test"] = Field("default", description="size of the built-in model")
    build_seed: int = 0
    # Request defaults sized so that one request takes seconds on 2 CPU cores.
    width: int = Field(96, ge=16)
    height: int = Field(96, ge=16)
    num_frames: int = Field(9, ge=1)
    num_inference_steps: int = Field(20, ge=1)
    guidance_scale: float = Field(5.0, ge=0)


class WorkerSettings(_Section):
    """Stage workers: delivery, leases, retries and how many of each ``diffcache up`` starts."""

    encode_workers: int = Field(1, ge=0)
    denoise_workers: int = Field(1, ge=0)
    decode_workers: int = Field(1, ge=0)
    idle_timeout_s: float = Field(30.0, gt=0, description="a silent job is reclaimed after this")
    max_deliveries: int = Field(3, ge=1, description="then the job goes to the dead letters")
    block_ms: int = Field(500, ge=1)
    # Jobs read, fenced and published together. Larger batches cut round trips for quick
    # stages; a batch holds its jobs' leases until the last one is done.
    batch_size: int = Field(1, ge=1, le=256)
    # Intra-op threads per stage (0: torch's default, every core). On small tensors one thread
    # per op wastes less than splitting each op; denoise gets its parallelism from cfg_parallel.
    encode_threads: int = Field(1, ge=0)
    denoise_threads: int = Field(1, ge=0)
    decode_threads: int = Field(1, ge=0)
    cfg_parallel: bool = Field(True, description="run the cond and uncond forwards concurrently")
    fps: int = Field(16, ge=1, description="frame rate of MP4 outputs")
    # Denoise writes a checkpoint every this many steps (0: a tenth of the request's steps, so
    # a crash loses about a tenth of a job), at every prompt switch and when it stops early.
    checkpoint_every: int = Field(0, ge=0)
    cfg_cache: bool = Field(True, description="exact reuse of unconditional predictions")
    decode_credits: int = Field(8, ge=1, description="trajectories denoising or awaiting decode")
    preempt: bool = Field(True, description="waiting interactive work preempts batch work")
    # An interactive entry must wait this long before it preempts: an idle worker takes it
    # within a round trip, and then nothing needs preempting.
    preempt_grace_ms: int = Field(100, ge=0)
    # A job re-queued or resumed this many times is no longer preempted, so batch work always
    # finishes however much interactive work arrives.
    max_preemptions: int = Field(3, ge=0)


class ApiSettings(_Section):
    """The REST API: where it listens, who may call it, and the limits it enforces."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # API key -> tenant. Empty: no authentication, every request is the default tenant.
    api_keys: dict[str, str] = Field(default_factory=dict)
    max_body_bytes: int = Field(65536, ge=1024)
    max_queue_depth: int = Field(1000, ge=1, description="deeper than this answers 429")
    retry_after_s: int = Field(5, ge=1)
    max_prompt_chars: int = Field(2000, ge=1)
    max_prompt_tokens: int = Field(511, ge=1, description="the text encoder's limit less EOS")
    max_width: int = Field(1024, ge=16)
    max_height: int = Field(1024, ge=16)
    max_frames: int = Field(129, ge=1)
    max_steps: int = Field(100, ge=1)
    spatial_multiple: int = Field(16, ge=1, description="VAE factor times DiT patch size")
    sync_timeout_s: float = Field(300.0, gt=0, description="synchronous endpoints wait this")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=_NESTED, extra="forbid", frozen=True
    )

    data_dir: Path = Field(Path(".diffcache"), description="logs and Valkey's AOF")
    bind_host: str = Field("127.0.0.1", description="address embedded services listen on")
    default_tenant: str = "default"
    store: StoreSettings = StoreSettings()
    redis: RedisSettings = RedisSettings()
    cache: CacheSettings = CacheSettings()
    model: ModelSettings = ModelSettings()
    workers: WorkerSettings = WorkerSettings()
    api: ApiSettings = ApiSettings()

    @property
    def model_dir(self) -> Path:
        return self.model.dir or self.data_dir / "model"


def _known_variables() -> set[str]:
    names = set()
    for name, field in Settings.model_fields.items():
        names.add(f"{ENV_PREFIX}{name}".upper())
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            names.update(f"{ENV_PREFIX}{name}{_NESTED}{sub}".upper()
                         for sub in section.model_fields)
    return names


def load_settings(**overrides: object) -> Settings:
    """Read settings from the process environment, with ``overrides`` (from the CLI) on top.

    Raises SettingsError naming the first unknown ``DIFFCACHE_*`` variable or invalid field.
    """
    known = _known_variables()
    unknown = sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX)
                     and k.upper() not in known)
    if unknown:
        raise SettingsError(f"unknown setting {unknown[0]}; known: {sorted(known)}")
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise SettingsError(f"setting {field}: {first['msg']}") from exc


def to_environ(settings: Settings) -> dict[str, str]:
    """The variables that make a child process load exactly ``settings``."""
    out: dict[str, str] = {}
    for name, value in settings.model_dump(mode="json", exclude_defaults=True).items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if v is not None:
                    text = json.dumps(v) if isinstance(v, dict | list) else str(v)
                    out[f"{ENV_PREFIX}{name}{_NESTED}{sub}".upper()] = text
        else:
            out[f"{ENV_PREFIX}{name}".upper()] = str(value)
    return out


def child_environ(settings: Settings) -> dict[str, str]:
    """The environment of a child process: ours, with DIFFCACHE_* replaced by ``settings``."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    return {**base, **to_environ(settings)}
