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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from keys import ReuseMode, StepCachePolicy

ENV_PREFIX = "DIFFCACHE_"
_DEVICE = r"^(auto|cpu|cuda(:\d+)?)$"  # a model device setting
_NESTED = "__"


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the variable or field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreSettings(_Section):
    """Mooncake Store: an external master, or the embedded one when ``master_address`` is unset."""

    master_address: str | None = Field(None, description="host:port of an external master")
    metadata_server: str | None = Field(None, description="http://host:port/metadata")
    master_metrics_url: str | None = Field(None, description="http://host:port/metrics of the "
                                           "master: tells a full store from one that lost "
                                           "every storage node")
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    # The address this process's Mooncake client advertises for transfers; a node of a cluster
    # sets it (``diffcache head`` and ``node`` default it to ``bind_host``).
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

    url: str | None = Field(None, description="redis[s]://[:password@]host:port/db of an "
                            "external server")
    port: int = Field(0, ge=0, le=65535, description="port of the embedded Valkey; 0 = free")
    # Required (``requirepass``) when the embedded Valkey binds beyond loopback.
    password: str | None = Field(None, description="password of the embedded Valkey")
    cluster: bool = Field(False, description="``url`` names one node of a Redis Cluster "
                          "(the client finds the others)")


class CacheSettings(_Section):
    """Per-kind lifetimes and the cross-process single-flight protocol."""

    checkpoint_ttl_s: float = Field(3600.0, gt=0)
    cfg_ttl_s: float = Field(600.0, gt=0)
    output_ttl_s: float = Field(86400.0, gt=0)
    latents_ttl_s: float = Field(3600.0, gt=0, description="safety net if never consumed")
    # The owner renews its lease every third of this while it computes, so a dead owner's
    # waiters take over within this long, while a slow computation keeps its lease.
    single_flight_lease_s: float = Field(5.0, gt=0)
    single_flight_wait_s: float = Field(60.0, gt=0)
    # Outputs are also written to files under <data_dir>/outputs (for their TTL), so a DONE
    # request's result outlives a restart of the whole service and the loss of the store.
    durable_outputs: bool = True
    stats_flush_s: float = Field(1.0, gt=0)
    sweep_interval_s: float = Field(30.0, gt=0)
    evict_interval_s: float = Field(2.0, gt=0, description="how often the value sweeper "
                                    "compares the bytes held with cache.evict_above")
    # Write admission (``cachesvc.write_admission``): a CFG feature of a tenant whose CFG
    # lookups, over the last ``admission_window_s``, number at least ``admission_min_lookups``
    # and hit less than ``admission_min_hit_rate`` of the time is written only on its key's
    # second write, or for one key in ``admission_sample``. A hit rate of 0 writes them all.
    admission_window_s: int = Field(600, ge=60, multiple_of=60,
                                    description="read from per-minute counters")
    admission_min_lookups: int = Field(1000, ge=1)
    admission_min_hit_rate: float = Field(0.01, ge=0.0, le=1.0)
    admission_sample: int = Field(20, ge=1)
    # Eviction by value (``cachesvc.value_sweep``): once the entries the cache indexes hold
    # more than ``evict_above`` of ``capacity_mib``, each sweep removes those worth least per
    # byte until they hold ``evict_to``, starting with the tenants over ``max_share``. The
    # watermark sits below Mooncake's own (0.95), so that its LRU rarely acts.
    capacity_mib: int | None = Field(None, ge=1, description="the store's memory over every "
                                     "storage node; unset: as the master reports it")
    evict_above: float = Field(0.85, gt=0.0, le=1.0)
    evict_to: float = Field(0.75, gt=0.0, le=1.0)
    max_share: float = Field(0.5, gt=0.0, le=1.0, description="of capacity_mib, a tenant's "
                             "bytes beyond which its own entries are evicted first")
    # A request's inputs (its embeddings, image latents) are kept from eviction from its
    # hand-off to denoise until decode is done with them, or for this long. Only decode lets
    # go: a request cancelled or failed on the way keeps its hold until it lapses, so the lapse
    # is short; one in flight for longer only loses the protection (lineage makes a lost input
    # again).
    inputs_held_s: float = Field(900.0, gt=0)
    # Every lookup and write of a valued entry, a JSON line each in a file per process here
    # (``cachesvc.lookup_log``), for replaying a trace against an offline optimum.
    lookup_log_dir: Path | None = Field(None, description="unset: no log")

    @model_validator(mode="after")
    def _evict_to_below_above(self) -> CacheSettings:
        if self.evict_to > self.evict_above:
            raise ValueError(f"cache.evict_to ({self.evict_to}) must not exceed "
                             f"cache.evict_above ({self.evict_above})")
        return self


class RetentionSettings(_Section):
    """How long Redis keeps what served requests leave behind, so it stays bounded under load."""

    finished_request_s: float = Field(7 * 24 * 3600.0, gt=0,
                                      description="a DONE, FAILED or CANCELLED record stays "
                                                  "readable this long after its last change")
    dead_letter_s: float = Field(7 * 24 * 3600.0, gt=0)
    # Whole seconds, because both are Redis EX values. An idempotency key that outlives its
    # request's record answers a resubmission with an id that reads as 404.
    idempotency_s: int = Field(24 * 3600, ge=1)
    stats_bucket_s: int = Field(7 * 24 * 3600, ge=60, description="per-minute counter buckets")
    # A consumer of a worker that exited stays in its group until it is forgotten; one with
    # nothing pending that has not polled for this long is removed.
    dead_consumer_s: float = Field(24 * 3600.0, gt=0)
    acknowledged_s: float = Field(0.0, ge=0, description="a stage-stream entry every worker "
                                  "has acknowledged stays this long, to inspect recent "
                                  "traffic with XRANGE; 0: removed at the next sweep")
    sweep_batch: int = Field(10_000, ge=1, description="request records examined per tenant "
                                                       "per sweep")


class ModelSettings(_Section):
    """The model every worker loads: a local folder, built on first start if it is missing."""

    # "auto": the family whose pipeline class the model folder's model_index.json names (a
    # folder still to be built gets the family whose preset it names). Otherwise a
    # name in the family registry (``workers.families``), or a plug-in family's import path
    # ("package.module:ATTRIBUTE", a ``Family``), which the registry checks: `diffcache up`
    # before it starts anything, and every worker.
    family: str = "auto"
    # Where denoise and decode run, which every trajectory and output key names. "auto":
    # CUDA when there is a GPU, else the CPU; "cuda" on a machine with several GPUs: `diffcache
    # up` gives its workers one each, in turn (README "GPUs"); "cuda:N": that one.
    device: str = Field("auto", pattern=_DEVICE)
    # Where the text and image encoders run: "same" as device, or another (an encode pool on
    # CPU beside GPU denoise workers). Name device explicitly then: "auto" on a CPU encode
    # machine would name the CPU in keys the GPU workers write under CUDA.
    encode_device: str = Field("same", pattern=rf"^same$|{_DEVICE}")
    # The DiT's and the text encoder's dtype; "auto": bfloat16 on CUDA and float32 on the CPU,
    # as the reference pipelines run. The VAE runs in float32, or in this dtype where the
    # family's pipelines run it so (its module says which).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    dir: Path | None = Field(None, description="default: <data_dir>/model")
    # What clients call the model: a request's ``model`` and ``GET /v1/models``'
    # ``family/name``. Unset: for the built-in folder (``<data_dir>/model``) the preset it
    # was built from, else the folder's name (``workers.main.model_name``).
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    preset: Literal["shapes", "default", "test"] = Field(
        "shapes", description="the built-in model: shapes (trained, shipped with the project), "
        "or a random one sized for timing (default) or for tests (test)")
    build_seed: int = 0
    # Request defaults; unset, they are the model folder's own (its diffcache.json), else
    # 96x96, 9 frames, 20 steps, guidance 5.
    width: int | None = Field(None, ge=16)
    height: int | None = Field(None, ge=16)
    num_frames: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0)


class DenoiseParallelSettings(_Section):
    """How one denoise worker spans ranks (a process each, on a device or a core each): its
    forwards' sequence split by diffusers' context parallelism, or their rows shared out
    (docs/design/parallel.md)."""

    # Ranks splitting each attention's heads (all-to-all) and its keys and values (a ring);
    # a worker is ulysses x ring x rows ranks, and 1 x 1 x 1 is one process on one device.
    ulysses: int = Field(1, ge=1, le=64)
    ring: int = Field(1, ge=1, le=64)
    # Or ranks taking each a part of a forward's rows (the conditional and unconditional rows
    # of one request included): for many short rows, where a sequence split gains little.
    # Each row is then computed whole, as alone, so keys stay those of one rank.
    rows: int = Field(1, ge=1, le=64)
    # Ulysses over head counts and sequence lengths its degree does not divide, at the price
    # of a gather of sizes per attention (diffusers' ``ulysses_anything``); ring must be 1.
    ulysses_anything: bool = False
    # Ranks wait this long for one another inside a forward (and for the next forward, so
    # it bounds how long a group may sit idle too); a dead rank ends its group at once.
    collective_timeout_s: float = Field(86400.0, gt=0)

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring * self.rows

    @model_validator(mode="after")
    def _one_split_at_a_time(self) -> DenoiseParallelSettings:
        if self.ulysses_anything and (self.ulysses < 2 or self.ring != 1):
            raise ValueError("workers.denoise_parallel.ulysses_anything needs ulysses of 2 or "
                             f"more and ring 1 (ulysses {self.ulysses}, ring {self.ring})")
        if self.rows > 1 and self.ulysses * self.ring > 1:
            raise ValueError("workers.denoise_parallel.rows splits rows, ulysses and ring the "
                             "sequence: set one or the other (both at once is not built yet)")
        return self


class WorkerSettings(_Section):
    """Stage workers: delivery, leases, retries and how many of each ``diffcache up`` starts."""

    encode_workers: int = Field(1, ge=0)
    # None: one per GPU where the model computes on CUDA, else one per CPU core, since a
    # worker runs one thread per op (``workers.launch``; docs "How many workers").
    denoise_workers: int | None = Field(
        None, ge=0, description="unset: one per GPU, or one per core on a CPU machine")
    decode_workers: int = Field(1, ge=0)
    idle_timeout_s: float = Field(30.0, gt=0, description="a silent job is reclaimed after this")
    max_deliveries: int = Field(3, ge=1, description="then the job goes to the dead letters")
    block_ms: int = Field(500, ge=1)
    # Jobs read, fenced and published together. Larger batches cut round trips for quick
    # stages; a batch holds its jobs' leases until the last one is done. (The denoise engine
    # reads as many as it has room for.)
    batch_size: int = Field(1, ge=1, le=256)
    # Intra-op threads per stage (0: torch's default, every core). On small tensors one thread
    # per op wastes less than splitting each op; denoise gets its parallelism from batching
    # rows and from cfg_parallel.
    encode_threads: int = Field(1, ge=0)
    denoise_threads: int = Field(1, ge=0)
    decode_threads: int = Field(1, ge=0)
    cfg_parallel: bool = Field(True, description="run a step's independent forwards (rows "
                               "the batch bounds split, or texts of different lengths where "
                               "a family cannot pad them) on two threads")
    # The denoise engine (docs/design/engine.md): the most runs a worker holds and steps
    # together, and the most rows one forward computes (the 16 rows of 8 runs with CFG are
    # two forwards, on two threads with cfg_parallel); runs whose step cache skips their rows
    # weigh less, up to ride_along times as many. On this CPU a forward of 16 shapes rows
    # costs about a third per row of a lone forward.
    max_batch: int = Field(8, ge=1, le=256)
    # How many times max_batch a worker's engine holds runs, and a forward rows, while step
    # caches skip some of them (1: never more). More runs a step is more requests a second, and
    # each request's step slower: on the shapes model at max_batch 8, first-block served 1.35x
    # exact's requests a second at 2 (1.17x at 1), each request denoising in 1.40x exact's
    # seconds (0.85x at 1).
    ride_along: int = Field(2, ge=1, le=4)
    # And the most token-rows (image plus text tokens, summed over its rows) one forward takes,
    # so activation memory stays bounded when the requests are large: 64k is two rows of a
    # 480p 81-frame video of the default video model, thousands of the shipped image model's.
    max_batch_tokens: int = Field(65536, ge=1)
    # Before it takes its first job, a denoise worker proves its batched rows exact at every
    # batch size it may form for the served model's default request geometry (README "The
    # denoise engine"), so no step of that geometry pays the proof while requests wait; for
    # at most this long (0: not at all), since it counts against the worker's start-up.
    warm_up_s: float = Field(60.0, ge=0)
    fps: int = Field(16, ge=1, description="frame rate of MP4 outputs")
    # Denoise writes a checkpoint every this many steps (0: a tenth of the request's steps, so
    # a crash loses about a tenth of a job), at every prompt switch and when it stops early.
    checkpoint_every: int = Field(0, ge=0)
    cfg_cache: bool = Field(True, description="exact reuse of unconditional predictions")
    lora_slots: int = Field(4, ge=1, description="LoRA adapters a denoise worker keeps loaded")
    # Route a denoise job to a worker that has its adapters loaded; a routed job waiting longer
    # than affinity_wait_ms goes to any worker, so none starves behind a busy or dead one.
    adapter_routing: bool = True
    affinity_wait_ms: int = Field(2000, ge=0)
    # Trajectories denoising or awaiting decode, over the whole cluster (None: twice max_batch
    # for each denoise worker this config starts, or for one if it starts none). A run takes
    # its credit before its first step, so with fewer credits than the engines hold runs,
    # rows sit idle whenever decode lags: set it to at least max_batch times the cluster's
    # denoise workers, plus the backlog decode may keep (an engine whose step caches skip
    # rows holds up to ride_along times max_batch runs, each with its credit).
    decode_credits: int | None = Field(None, ge=1)
    preempt: bool = Field(True, description="waiting interactive work preempts batch work")
    # An interactive entry must wait this long before a full engine makes way for it. An idle
    # worker has read it on arrival, so none is needed for that; with several denoise workers,
    # a step time or so lets one that will have room at its next boundary take it instead.
    preempt_grace_ms: int = Field(0, ge=0)
    # A job re-queued or resumed this many times is no longer preempted, so batch work always
    # finishes however much interactive work arrives.
    max_preemptions: int = Field(3, ge=0)
    # A stage whose input was lost from the store sends the request back to the stage that
    # produces it; past this many such recomputes the store keeps losing entries, and the
    # request fails with that reason.
    max_recomputes: int = Field(8, ge=0)
    # While the store is unreachable a stage waits and retries rather than burning deliveries;
    # past this long the delivery counts as failed.
    outage_budget_s: float = Field(120.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0, description="how often a worker says it is alive")
    # The sweeper's watchdog re-queues a request that has neither a live owner nor an entry
    # anyone will deliver once it has not moved for this long. 0: three idle timeouts, well
    # past the 1.25 idle timeouts a takeover needs, so takeover always comes first.
    orphan_after_s: float = Field(0.0, ge=0)
    # On SIGTERM a worker takes no new job; a denoise job checkpoints and is re-queued, others
    # finish. Past this long the supervisor kills what is left.
    shutdown_grace_s: float = Field(30.0, gt=0)
    denoise_parallel: DenoiseParallelSettings = DenoiseParallelSettings()

    @model_validator(mode="after")
    def _credits_fill_an_engine(self) -> WorkerSettings:
        if self.decode_credits is not None and self.decode_credits < self.max_batch:
            raise ValueError(f"workers.decode_credits ({self.decode_credits}) is below "
                             f"workers.max_batch ({self.max_batch}): an engine could never "
                             "step a full batch")
        return self

    @property
    def credit_limit(self) -> int:
        """``decode_credits``, or its default."""
        return self.decode_credits or 2 * self.max_batch * max(1, self.denoise_workers or 1)

    @property
    def orphan_bound_s(self) -> float:
        return self.orphan_after_s or 3 * self.idle_timeout_s

    @property
    def live_within_s(self) -> float:
        """A worker whose heartbeat is older than this is taken for gone."""
        return max(5.0, 5 * self.heartbeat_s)


class ApiSettings(_Section):
    """The REST API: where it listens, who may call it, and the limits it enforces."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # API key -> tenant. With no api_keys and no admin_keys there is no authentication, and
    # every request is the default tenant.
    api_keys: dict[str, str] = Field(default_factory=dict)
    # Keys that read every tenant's dashboard. They map to no tenant, so they cannot generate.
    admin_keys: list[str] = Field(default_factory=list)
    # A scrape of /metrics is unauthenticated and a tenant's name may name a customer: "auto"
    # labels plain names without keys and a short digest (t-<12 hex>) once keys are set.
    metrics_tenant_labels: Literal["auto", "plain", "hashed"] = "auto"
    max_body_bytes: int = Field(65536, ge=1024)
    max_adapter_bytes: int = Field(512 * 2**20, ge=1024, description="largest LoRA upload")
    max_image_bytes: int = Field(32 * 2**20, ge=1024, description="largest image upload")
    # Checked from the image's header, before any pixel is decoded: a small file may claim
    # billions of pixels (a decompression bomb).
    max_image_pixels: int = Field(4096 * 4096, ge=64 * 64)
    max_loras: int = Field(4, ge=1, description="adapters one request may apply")
    # Tenant -> the step-cache policy (at its default parameters) of its requests that name
    # none: a tenant may opt all its traffic into an approximate policy.
    step_cache_defaults: dict[str, StepCachePolicy] = Field(default_factory=dict)
    # Tenant -> the reuse mode of its requests that name none: a tenant may opt all its
    # traffic into approximate reuse (at the default similarity and skip).
    reuse_defaults: dict[str, ReuseMode] = Field(default_factory=dict)
    max_queue_depth: int = Field(1000, ge=1, description="deeper than this answers 429")
    max_jobs_per_tenant: int = Field(200, ge=1, description="one tenant's queued plus running "
                                     "requests; more answers 429")
    retry_after_s: int = Field(5, ge=1)
    max_prompt_chars: int = Field(2000, ge=1)
    max_prompt_tokens: int = Field(511, ge=1, description="the text encoder's limit less EOS")
    max_width: int = Field(1024, ge=16)
    max_height: int = Field(1024, ge=16)
    max_frames: int = Field(129, ge=1)
    max_steps: int = Field(100, ge=1)
    spatial_multiple: int = Field(1, ge=1, description="a multiple width and height must "
                                  "also be, on top of the served model's own (its VAE factor "
                                  "times its DiT patch size, which the workers publish)")
    # A model card may state the largest size its model serves; above it a request is a 422.
    enforce_model_max: bool = True
    sync_timeout_s: float = Field(300.0, gt=0, description="synchronous endpoints wait this")
    # Estimated compute of one request, in token-forwards (latent frames x patches x forwards,
    # a CFG step counting two): above max_cost a request is refused, so none holds a worker
    # for hours; above interactive_max_cost an interactive request runs as batch work.
    max_cost: int = Field(5_000_000, ge=1)
    interactive_max_cost: int = Field(500_000, ge=1)
    public_url: str | None = Field(None, description="absolute base of links in answers "
                                   "(https://api.example.com); default: the request's own")

    def model_post_init(self, context: object, /) -> None:
        # A key that is both would be a tenant that can read every other tenant's rows.
        if shared := set(self.admin_keys) & set(self.api_keys):
            raise SettingsError(f"api.admin_keys and api.api_keys share {len(shared)} key(s); "
                                "an admin key must map to no tenant")

    @property
    def authenticated(self) -> bool:
        """Whether callers must send a key: any tenant or admin key is configured."""
        return bool(self.api_keys or self.admin_keys)


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
    retention: RetentionSettings = RetentionSettings()
    model: ModelSettings = ModelSettings()
    workers: WorkerSettings = WorkerSettings()
    api: ApiSettings = ApiSettings()

    @model_validator(mode="after")
    def _admission_window_is_kept(self) -> Settings:
        if self.cache.admission_window_s > self.retention.stats_bucket_s:
            raise ValueError(f"cache.admission_window_s ({self.cache.admission_window_s}) is "
                             f"above retention.stats_bucket_s "
                             f"({self.retention.stats_bucket_s}): write admission reads the "
                             "per-minute counters of its window")
        return self

    @model_validator(mode="after")
    def _adapters_fit_a_worker(self) -> Settings:
        if self.api.max_loras > self.workers.lora_slots:
            raise ValueError(f"api.max_loras ({self.api.max_loras}) is above "
                             f"workers.lora_slots ({self.workers.lora_slots}): a request "
                             "with that many adapters could never run")
        return self

    @property
    def model_dir(self) -> Path:
        return self.model.dir or self.built_in_model_dir

    @property
    def built_in_model_dir(self) -> Path:
        """Where ``model.dir`` points by default: the folder built from ``model.preset``."""
        return self.data_dir / "model"

    @property
    def outputs_dir(self) -> Path:
        return self.data_dir / "outputs"

    @property
    def checkpoints_dir(self) -> Path:
        """Checkpoints a denoise job wrote as it stopped early (a drain, a preemption)."""
        return self.data_dir / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"


def _known_variables(model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX) -> set[str]:
    """Every ``DIFFCACHE_*`` name a setting answers to, sections within sections included."""
    names = set()
    for name, field in model.model_fields.items():
        names.add(f"{prefix}{name}".upper())
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            names |= _known_variables(section, f"{prefix}{name}{_NESTED}")
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
        message = first["msg"].removeprefix("Value error, ")
        raise SettingsError(f"setting {field}: {message}" if field else message) from exc


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
