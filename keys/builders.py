"""Key builders, one per key kind, each stating which request fields it covers.

A builder hashes exactly the inputs that determine the bytes of its entry, so two requests share
an entry only when they must produce bit-identical tensors. ``FieldPolicy`` lists, per builder,
the ``GenerationSpec`` fields it includes and those it deliberately ignores; a test keeps both
lists complete as the spec grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from keys.canonical import Canonical, digest
from keys.names import KeyKind, StoreKey, check_tenant
from keys.spec import SPEC_FIELDS, GenerationSpec, ImageInput, LoraUse, StepCachePolicy


@dataclass(frozen=True, slots=True)
class FieldPolicy:
    """The spec fields a key includes, and the ones it ignores on purpose (with the reason)."""

    includes: frozenset[str]
    ignores: Mapping[str, str]

    def __post_init__(self) -> None:
        overlap = self.includes & self.ignores.keys()
        if overlap:
            raise ValueError(f"fields both included and ignored: {sorted(overlap)}")

    @property
    def uncovered(self) -> frozenset[str]:
        return SPEC_FIELDS - self.includes - self.ignores.keys()


_ROUTING = {
    "request_id": "names one request, not its content",
    "priority": "changes when work runs, never its result",
    # An approximate hit rewrites the spec itself (another seed, a schedule that starts with
    # the other request's prompt): the rewritten fields are what every key holds.
    "reuse": "decides whether the request may be rewritten, never what a spec computes",
}

EMBEDDING_FIELDS = FieldPolicy(
    includes=frozenset({"tenant", "schedule"}),
    ignores={
        **_ROUTING,
        "loras": "adapters apply to the denoiser only (text-encoder adapters are refused)",
        "width": "the text encoder never sees the output size",
        "height": "the text encoder never sees the output size",
        "num_frames": "the text encoder never sees the output size",
        "num_inference_steps": "the text encoder runs once per text",
        "guidance_scale": "applied after the encoder",
        "seed": "the text encoder is deterministic",
        "output_format": "applied after decode",
        "cfg_cache": "applied after the encoder",
        "step_cache": "applied to the denoiser",
        # An input image starts or conditions the denoiser; the prompt is encoded alone.
        "image": "the text encoder never sees an input image",
    },
)
IMAGE_EMBEDDING_FIELDS = FieldPolicy(
    # An instruction is read with the image it edits: the image's hash enters (with its
    # strength and mask, which an edit leaves unset, so that no other workflow shares one).
    includes=EMBEDDING_FIELDS.includes | {"image"},
    ignores={f: why for f, why in EMBEDDING_FIELDS.ignores.items() if f != "image"},
)
CHAIN_FIELDS = FieldPolicy(
    # cfg_cache counts only in its approximate mode; the exact tier never changes an output.
    # step_cache counts whenever a policy is on: every policy changes the output.
    # loras enter through the denoiser's fingerprint (``adapted``), which every DiT key holds.
    # image enters as its hash and the step its strength starts at: they decide where the
    # trajectory starts and from what (or, for image-to-video, what conditions each step).
    includes=frozenset(
        {"tenant", "schedule", "width", "height", "num_frames", "num_inference_steps",
         "guidance_scale", "seed", "cfg_cache", "loras", "step_cache", "image"}
    ),
    ignores={**_ROUTING, "output_format": "applied after decode"},
)
# The latent digest in a CFG key carries the whole trajectory so far, hence the same fields.
CFG_FIELDS = CHAIN_FIELDS
LATENTS_FIELDS = FieldPolicy(
    includes=frozenset({"tenant", "request_id"}),
    ignores={f: "final latents are keyed by request, read once and deleted"
             for f in SPEC_FIELDS - {"tenant", "request_id"}},
)
OUTPUT_FIELDS = FieldPolicy(
    includes=CHAIN_FIELDS.includes | {"output_format"},
    ignores=_ROUTING,
)
FIELD_POLICIES: Mapping[KeyKind, FieldPolicy] = {
    KeyKind.EMBEDDING: EMBEDDING_FIELDS,
    KeyKind.IMAGE_EMBEDDING: IMAGE_EMBEDDING_FIELDS,
    KeyKind.CHECKPOINT: CHAIN_FIELDS,
    KeyKind.CFG: CFG_FIELDS,
    KeyKind.LATENTS: LATENTS_FIELDS,
    KeyKind.OUTPUT: OUTPUT_FIELDS,
}


# --- model fingerprints -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Identity of one model component: config, weights, dtype and device class."""

    role: str
    hex: str

    def __str__(self) -> str:
        return f"{self.role}:{self.hex}"


def file_digest(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """xxh3-128 of a weight file's bytes, read in chunks so large checkpoints fit in memory."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(
    role: str,
    config: Mapping[str, Canonical],
    weight_digests: Mapping[str, str],
    dtype: str,
    device_class: str,
) -> Fingerprint:
    """Fingerprint of a component from its config, its weight files' digests, dtype and device.

    ``device_class`` (``cpu``, ``cuda``) is included because kernels differ across devices, so
    tensors computed on one are not bit-identical to tensors computed on the other.
    """
    payload: dict[str, Canonical] = {
        "config": config,
        "weights": dict(weight_digests),
        "dtype": dtype,
        "device_class": device_class,
    }
    return Fingerprint(role=role, hex=digest("model", payload))


def adapted(model: Fingerprint, loras: Sequence[LoraUse]) -> Fingerprint:
    """The denoiser as a request runs it: ``model`` with ``loras`` applied at their scales.
    Without adapters it is ``model`` itself, so every existing key stays valid."""
    if not loras:
        return model
    payload: dict[str, Canonical] = {
        "model": model.hex, "loras": [[lora.hash, float(lora.scale)] for lora in loras]}
    return Fingerprint(role=model.role, hex=digest("adapted", payload))


def adapter_key(tenant: str, content_hash: str) -> StoreKey:
    """A LoRA adapter's safetensors bytes, named by their content."""
    return StoreKey(check_tenant(tenant), KeyKind.ADAPTER, content_hash)


def image_key(tenant: str, content_hash: str) -> StoreKey:
    """An input image's normalised pixels (PNG), named by the hash of those pixels."""
    return StoreKey(check_tenant(tenant), KeyKind.IMAGE, content_hash)


def image_latent_key(tenant: str, encoder: Fingerprint, content_hash: str,
                     size: tuple[int, int, int] | None) -> StoreKey:
    """The VAE's encoding of an input image resized to ``size``, (width, height, frames) (for
    image-to-video, as the first of the frames): one per image and geometry, whatever the
    prompt, seed or strength. ``None`` for an encoder whose size follows from the image alone
    (its rule in ``encoder``)."""
    payload: dict[str, Canonical] = {"encoder": encoder.hex, "image": content_hash,
                                     "size": list(size) if size is not None else None}
    return StoreKey(check_tenant(tenant), KeyKind.IMAGE_LATENT,
                    digest("image-latent", payload))


def image_mask_key(tenant: str, processor: Fingerprint, content_hash: str, width: int,
                   height: int) -> StoreKey:
    """An inpainting mask resized to ``width`` x ``height``, binarised and brought to the
    latents' size: one per mask and size, whatever the image it masks."""
    payload: dict[str, Canonical] = {"processor": processor.hex, "mask": content_hash,
                                     "size": [width, height]}
    return StoreKey(check_tenant(tenant), KeyKind.IMAGE_MASK, digest("image-mask", payload))


# --- store keys -------------------------------------------------------------------------------


def embedding_key(
    tenant: str,
    encoder: Fingerprint,
    token_ids: Sequence[int],
    attention_mask: Sequence[int],
    max_length: int,
) -> StoreKey:
    """Condition embedding of one tokenized text; the raw string is deliberately not used."""
    payload: dict[str, Canonical] = {
        "encoder": encoder.hex,
        "ids": list(token_ids),
        "mask": list(attention_mask),
        "max_length": max_length,
    }
    return StoreKey(check_tenant(tenant), KeyKind.EMBEDDING, digest("embed", payload))


def image_embedding_key(
    tenant: str,
    encoder: Fingerprint,
    token_ids: Sequence[int],
    image: ImageInput,
) -> StoreKey:
    """Condition embedding of one tokenized text read with ``image`` (its template's image
    tokens are the image's: how many, and what they hold, follow from the pixels and the
    encoder's fingerprint, which carries its processor and condition size)."""
    payload: dict[str, Canonical] = {
        "encoder": encoder.hex,
        "ids": list(token_ids),
        "image": {"hash": image.hash, "strength": image.strength, "mask": image.mask},
    }
    return StoreKey(check_tenant(tenant), KeyKind.IMAGE_EMBEDDING, digest("image-embed", payload))


def cfg_key(
    tenant: str,
    model: Fingerprint,
    uncond_embedding: StoreKey,
    timestep: float,
    latent_digest: str,
    condition: StoreKey | None = None,
) -> StoreKey:
    """Unconditional prediction for one exact (model, negative prompt, timestep, latent) input,
    and the image ``condition`` the forward also takes (image-to-video), if any."""
    payload: dict[str, Canonical] = {
        "model": model.hex,
        "uncond": str(uncond_embedding),
        "timestep": float(timestep),
        "latent": latent_digest,
    }
    if condition is not None:
        payload["condition"] = str(condition)
    return StoreKey(check_tenant(tenant), KeyKind.CFG, digest("cfg", payload))


def tensor_digest(data: bytes | memoryview, dtype: str, shape: Sequence[int]) -> str:
    """Digest of a tensor's exact bytes, dtype and shape, as used for latents in CFG keys."""
    h = xxhash.xxh3_128(data)
    return digest("tensor", {"bytes": h.hexdigest(), "dtype": dtype, "shape": list(shape)})


@dataclass(frozen=True, slots=True)
class ChainLink:
    """Link ``h(index)`` of a request's trajectory hash chain; ``h(k)`` names the state after
    ``k`` denoising steps."""

    tenant: str
    index: int
    hex: str

    def checkpoint_key(self) -> StoreKey:
        return StoreKey(self.tenant, KeyKind.CHECKPOINT, f"{self.index}-{self.hex}")


def checkpoint_step(key: StoreKey) -> int | None:
    """The step a checkpoint's key names (``ChainLink.checkpoint_key``); None for any other
    key."""
    step, dash, _ = key.ident.partition("-")
    if key.kind is not KeyKind.CHECKPOINT or not dash or not step.isdigit():
        return None
    return int(step)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything that step ``k`` adds to the trajectory besides the state before it."""

    timestep: float
    cond: StoreKey
    uncond: StoreKey | None
    guidance_scale: float


def chain_root(
    spec: GenerationSpec,
    model: Fingerprint,
    scheduler_config: Mapping[str, Canonical],
    dtype: str,
    mag_ratios: Sequence[float] = (),
    image_encoder: Fingerprint | None = None,
) -> ChainLink:
    """``h0 = H(model fp, scheduler config, shape, seed, steps, dtype)``, plus for a request
    with an input image the image, the step its strength starts at (strengths that start at
    one step run one trajectory; 0 for image-to-video), its inpainting mask if any, and the
    ``image_encoder`` that turns it into latents or a condition, the CFG
    reuse interval when the request asked for the approximate tier, and the step-cache policy
    with its parameters when one is on (MagCache's with the model's calibrated
    ``mag_ratios``, which decide its skips as much as its parameters do): such a trajectory
    is its own."""
    payload: dict[str, Canonical] = {
        "model": model.hex,
        "scheduler": scheduler_config,
        "shape": [spec.num_frames, spec.height, spec.width],
        "seed": spec.seed,
        "steps": spec.num_inference_steps,
        "dtype": dtype,
    }
    if spec.image is not None:
        if image_encoder is None:
            raise ValueError(f"request {spec.request_id} starts from an image: its chain "
                             "root needs the encoder that turns it into latents")
        image: dict[str, Canonical] = {"hash": spec.image.hash,
                                       "first_step": spec.first_step,
                                       "encoder": image_encoder.hex}
        if spec.image.mask is not None:  # inpainting: what every step keeps of the image
            image["mask"] = spec.image.mask
        payload["image"] = image
    if spec.cfg_cache.approximate:
        payload["cfg_interval"] = spec.cfg_cache.interval
    if spec.step_cache.on:
        step_cache: dict[str, Canonical] = {"policy": spec.step_cache.policy.value,
                                            **dict(spec.step_cache.params)}
        if spec.step_cache.policy is StepCachePolicy.MAGCACHE:
            step_cache["mag_ratios"] = [float(r) for r in mag_ratios]
        payload["step_cache"] = step_cache
    return ChainLink(spec.tenant, 0, digest("chain-root", payload))


def reuse_bucket(root: ChainLink, uncond: StoreKey | None, guidance_scale: float,
                 view: str) -> str:
    """The bucket of requests whose trajectories may share a prefix: everything that shapes
    one but the prompt and the seed. ``root`` is the chain root of the request with its seed
    set to 0 (model and adapters, scheduler, shape, steps, dtype, step and CFG caches);
    ``uncond`` its negative prompt's embedding key and ``guidance_scale`` its guidance, the
    other inputs of every chain link. ``view`` names how its prompts became vectors: vectors
    of two views are never compared."""
    return digest("reuse-bucket", {"root": root.hex, "tenant": root.tenant,
                                   "uncond": None if uncond is None else str(uncond),
                                   "guidance": float(guidance_scale), "view": view})


def chain_next(link: ChainLink, step: StepInputs) -> ChainLink:
    """``h(k+1) = H(h(k), inputs of step k)``."""
    payload: dict[str, Canonical] = {
        "prev": link.hex,
        "timestep": float(step.timestep),
        "cond": str(step.cond),
        "uncond": None if step.uncond is None else str(step.uncond),
        "guidance": float(step.guidance_scale),
    }
    return ChainLink(link.tenant, link.index + 1, digest("chain-link", payload))


def chain(root: ChainLink, steps: Sequence[StepInputs]) -> list[ChainLink]:
    """All links ``h0..hN`` for the given per-step inputs."""
    links = [root]
    for step in steps:
        links.append(chain_next(links[-1], step))
    return links


def latents_key(tenant: str, request_id: str, fence_token: int) -> StoreKey:
    """Final latents of one delivery of a request: single consumer, deleted once decoded. One
    entry per delivery, so an attempt that was fenced out never overwrites or deletes the
    entry of the attempt that owns the request."""
    return StoreKey(check_tenant(tenant), KeyKind.LATENTS, f"{request_id}-{fence_token}")


def output_key(head: ChainLink, decoder: Fingerprint, output_format: str) -> StoreKey:
    """Encoded output of a finished trajectory, so an identical request is answered at once."""
    payload: dict[str, Canonical] = {"head": head.hex, "steps": head.index, "decoder": decoder.hex,
               "format": output_format}
    return StoreKey(head.tenant, KeyKind.OUTPUT, digest("output", payload))
