"""The one home of every key string: store keys, Redis keys and their versioned format.

Every key starts with the format version and the tenant, ``v1:<tenant>:<kind>:<id>``, so one
tenant never sees another's entries and a format change never mixes with old entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

KEY_VERSION = "v1"

# Tenants are user-facing names; the pattern keeps ':' (the separator) out and leaves names
# that start with '_' to the system namespace below.
_TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
SYSTEM_NAMESPACE = "_system"


class InvalidTenantError(ValueError):
    """A tenant name that cannot be used as a key namespace."""

    def __init__(self, tenant: str) -> None:
        super().__init__(
            f"tenant {tenant!r} is not a valid namespace: use 1-63 characters of [a-z0-9_-], "
            "starting with a letter or digit"
        )
        self.tenant = tenant


@lru_cache(maxsize=4096)  # every key of every request is built through it
def check_tenant(tenant: str) -> str:
    """Return ``tenant`` unchanged if it is a valid namespace, else raise InvalidTenantError."""
    if not _TENANT_RE.fullmatch(tenant):
        raise InvalidTenantError(tenant)
    return tenant


class KeyKind(StrEnum):
    """What a store entry holds; each kind has its own cache policy and counters."""

    EMBEDDING = "embed"
    CFG = "cfg"
    CHECKPOINT = "ckpt"
    LATENTS = "latents"
    OUTPUT = "output"
    ADAPTER = "adapter"  # a LoRA's safetensors, by content hash, uploaded per tenant
    IMAGE = "image"  # an input image's normalised pixels as PNG, by their hash, per tenant
    # The VAE's encoding of an input image at a request's size (its latent distribution),
    # by the image, the size and the encoder: what image-to-image starts from.
    IMAGE_LATENT = "image_latent"
    # A text's condition embedding read together with an input image (an instruction-editing
    # model's): by the text's token ids, the image and the encoder.
    IMAGE_EMBEDDING = "image_embed"
    # An inpainting mask brought to the latents' size (resized and binarised, no VAE), by the
    # mask, the size and the processor: what every step of an inpainting keeps or repaints.
    IMAGE_MASK = "image_mask"
    # Denoiser forwards under a step-cache policy: counted (a hit is a forward the policy
    # skipped part of), never stored; its state travels inside checkpoints.
    STEP = "step"
    # Approximate reuse lookups (a hit is a request rewritten to start from a similar
    # request's checkpoint), never stored: the checkpoint it starts from is a CHECKPOINT hit.
    APPROXIMATE = "approx"
    # Entries written by tests and benchmarks that do not belong to the pipeline.
    SCRATCH = "scratch"


@dataclass(frozen=True, slots=True)
class StoreKey:
    """A tenant-namespaced key of one store entry; ``str(key)`` is the Mooncake key."""

    tenant: str
    kind: KeyKind
    ident: str

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if not self.ident or ":" in self.ident:
            raise ValueError(f"key id {self.ident!r} must be non-empty and contain no ':'")

    def __str__(self) -> str:
        return f"{KEY_VERSION}:{self.tenant}:{self.kind.value}:{self.ident}"

    @classmethod
    def parse(cls, text: str) -> StoreKey:
        """Inverse of ``str``; raises ValueError on anything not written by this module."""
        parts = text.split(":")
        if len(parts) != 4 or parts[0] != KEY_VERSION:
            raise ValueError(f"{text!r} is not a {KEY_VERSION} store key")
        return cls(tenant=parts[1], kind=KeyKind(parts[2]), ident=parts[3])


# Redis keys. Each function documents the Redis type it names.
#
# Redis Cluster hashes only the part of a key inside its first ``{...}``. Each queue script
# moves a request between stage streams, its record, the admission sets and the decode credits
# in one atomic call, and a batch holds many requests, so no finer split keeps a script's keys
# in one slot: every key a queue script touches carries this one tag, and the queue lives on
# one master (with its replicas). Everything else (cache counters, TTL index, single-flight
# locks, adapters, reuse vectors, heartbeats, engine figures) spreads over the cluster. The tag
# comes before every id, and tenant names cannot hold braces, so nothing a caller names can
# move a key to another slot.
QUEUE_TAG = "{q}"
# The served model and its tokenizers change in one transaction (``served_model.py``).
MODEL_TAG = "{model}"


def flight_lock(key: StoreKey) -> str:
    """String: the owner of the single-flight computation of ``key`` (SET NX PX)."""
    return f"{key}:flight"


def ttl_index(tenant: str) -> str:
    """Sorted set: store keys of ``tenant`` scored by their expiry time in unix ms."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:ttl-index"


def value_keys(tenant: str) -> tuple[str, str, str, str, str]:
    """What ``tenant``'s cached entries are worth (``cachesvc.value_index``), in one slot (a
    script updates them together): a hash of each entry's record (store key -> "kind size
    cost reads class"), a sorted set of store keys by eviction priority, a hash of the bytes
    held per kind, a hash of the entries written and their reads per class (a kind, or
    ``ckpt@<step>``: ``<class>:entries``, ``<class>:reads``), and a sorted set of the inputs
    requests in flight hold (``<request id>|<store key>``, by the time the hold lapses)."""
    prefix = f"{KEY_VERSION}:{check_tenant(tenant)}:value:{{{tenant}}}"
    return (f"{prefix}:entries", f"{prefix}:priority", f"{prefix}:held", f"{prefix}:reuse",
            f"{prefix}:needed")


def value_clock() -> str:
    """String: the eviction clock, the priority of the last entry the sweeper removed; a new
    or read entry's priority starts from it (GreedyDual's inflation)."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:value-clock"


def write_seen(key: StoreKey) -> str:
    """String: a write of ``key`` that the cache refused (``cachesvc.write_admission``), kept
    for the admission window so that the key's next write is taken."""
    return f"{key}:seen"


def stats_bucket(tenant: str, minute: int) -> str:
    """Hash: counters of ``tenant`` for one unix minute, field ``<kind>.<counter>``."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:stats:{minute}"


def stats_total(tenant: str) -> str:
    """Hash: counters of ``tenant`` since the stack started, field ``<kind>.<counter>``."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:stats:total"


def stage_latency(stage: str, priority: str) -> str:
    """Hash: histogram of the job seconds of one stage and priority class, fields
    ``le:<bound>``, ``sum`` and ``count``."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:latency:{stage}:{priority}"


def tenants_registry() -> str:
    """Set: every tenant that has written counters, so a dashboard can list them."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:tenants"


def call_waiters(tenant: str, call: str) -> str:
    """String: how many synchronous callers wait on the request of one call (an idempotency
    key, or an OpenAI call's body digest); the last to leave an abandoned call cancels it."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:call-waiters:{call}"


def adapter_index(tenant: str) -> str:
    """Hash: a tenant's LoRA adapters, name -> JSON (hash, size, rank, targets)."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:adapters"


def reuse_vectors(tenant: str, bucket: str) -> str:
    """Stream: the pooled prompt vector of every request in one reuse bucket (everything that
    shapes a trajectory's prefix but its prompt and seed), in the order they registered."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:reuse:{bucket}"


def engine_rows() -> str:
    """Hash: ``rows:<n>`` -> transformer forwards of the denoise engines that took n rows."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:engine:rows"


def engine_join_wait() -> str:
    """Hash: histogram of the seconds from a denoise job's arrival in its stream to its first
    step in an engine, fields ``le:<bound>``, ``sum`` and ``count``."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:engine:join-wait"


def engine_occupancy() -> str:
    """Hash: consumer name -> ``<runs held> <capacity>`` of that denoise worker's engine."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:engine:occupancy"


def adapter_stats() -> str:
    """Hash: consumer name -> JSON of that denoise worker's adapter loads, swaps and holdings."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:adapter-stats"


def lora_targets() -> str:
    """Hash: the served denoiser's linear layers, module name -> "out,in", published by denoise
    workers so the API can validate an adapter without loading the model."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:lora-targets"


def request_record(tenant: str, request_id: str) -> str:
    """Hash: the state, timings and results of one request (``workers.queue.records``)."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:{QUEUE_TAG}:req:{request_id}"


def request_record_lua() -> str:
    """``request_record`` as a Lua function of (tenant, request_id), for the queue script that
    reads a job and claims its record in one call (``workers/queue/lua/take.lua``); the job was
    written by a script from a checked tenant. ``tests/test_scripts.py`` checks the two agree."""
    return (f'function(tenant, id) return "{KEY_VERSION}:" .. tenant .. ":{QUEUE_TAG}:req:" '
            ".. id end")


def request_index(tenant: str) -> str:
    """Sorted set: request ids of ``tenant`` scored by submission time in unix ms."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:{QUEUE_TAG}:requests"


def active_requests() -> str:
    """Sorted set: record keys (``request_record``) of every tenant's queued or running
    requests, scored by admission time in unix ms. Members whose request finished, was parked or
    is gone are dropped lazily at the next admission (``workers.queue.submit``)."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:active"


def tenant_active_requests(tenant: str) -> str:
    """Sorted set: record keys of ``tenant``'s queued or running requests, kept as
    ``active_requests`` is."""
    return f"{KEY_VERSION}:{check_tenant(tenant)}:{QUEUE_TAG}:active"


def stage_stream(stage: str, priority: str) -> str:
    """Stream: jobs of one priority class for one stage's worker pool. Shared by tenants; each
    job names its tenant."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:stream:{stage}:{priority}"


def decode_credits() -> str:
    """Sorted set: the requests holding a decode credit (denoising, or latents not yet decoded),
    scored by when they took it."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:credits:decode"


def rescued_requests() -> str:
    """Hash: ``<stage>:<reason>`` -> requests the watchdog re-queued because nothing would
    ever have delivered them; in normal operation it stays empty."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:rescued"


def dead_letter_stream() -> str:
    """Stream: jobs that failed more deliveries than allowed, with the reason."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:stream:dead"


def supervised_children() -> str:
    """Hash: ``<host>/<child>`` -> JSON status of each child a supervisor keeps running."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:children"


def served_model() -> str:
    """String: JSON naming the model family and folder the workers serve."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{MODEL_TAG}:served-model"


def admission_limits() -> str:
    """String: JSON of the limits the API admits requests under, which it publishes at start,
    so ``diffcache submit`` on any machine admits under the same ones."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:admission-limits"


def served_tokenizer(digest: str) -> str:
    """String: the served model's tokenizer (its ``tokenizer.json``), under its content hash,
    so the API counts a prompt's tokens as the workers will without the model folder."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{MODEL_TAG}:tokenizer:{digest}"


def worker_inbox(stage: str, consumer: str) -> str:
    """Stream: jobs routed to one worker (a denoise job to the worker that has its LoRA
    adapters loaded), read through the stage's consumer group like the shared streams."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:{QUEUE_TAG}:inbox:{stage}:{consumer}"


def worker_inboxes(stage: str) -> str:
    """Set: every ``worker_inbox`` of ``stage``, so any worker can take over a stale one."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:inboxes:{stage}"


def worker_heartbeats(stage: str) -> str:
    """Sorted set: consumer names of ``stage``'s workers scored by their last heartbeat (ms)."""
    return f"{KEY_VERSION}:{SYSTEM_NAMESPACE}:heartbeats:{stage}"


def consumer_group(stage: str) -> str:
    return f"{stage}-workers"
