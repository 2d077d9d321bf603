"""Image inputs: requests that start from or animate an uploaded image, served by diffcache
and by the monolithic pipelines, one workload per family.

Edits: ten input images (renders of held-out scenes of the shapes dataset), each edited by six
prompts that ask for the shape in each other colour, every other image on each of two models
(a picture is edited on one deployment, so each is encoded by one model). On the shipped
shapes model, by the scene's caption recoloured: image-to-image (its family's image-to-image
pipeline, strengths 0.6 and 0.8) and inpainting under a mask over the shape's box (its
inpainting pipeline, strengths 0.8 and 1.0), in turn. On a random model of the built-in
instruction-editing family, ``default`` preset, by an instruction ("make the circle green"):
instruction editing (its pictures mean nothing, its cost does). Image-to-video: four more
renders, each animated by five prompts, on a tiny random model of the built-in image-to-video
family. The report gives the condition-image encodes (the
``image_latent`` kind's lookups that missed: the goal is one per image, model and geometry;
masks are counted apart, ``image_mask``, and so are instructions read with their image,
``image_embed``, which are one per instruction by nature), whether a sample of each family's
outputs equals its pipeline's (one thread per op, as the workers run), the throughput against
the pipelines serving the same requests one after another, and what the attribute classifier
reads in the shapes model's edits: the colour asked for, and the shape kept.
"""
from __future__ import annotations

import dataclasses
import io
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from bench.common import bench_parser, collect, model_stack, report, workers
from bench.e2e import placement_of
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import GenerationSpec, ImageInput, KeyKind, OutputFormat, image_key
from training.classifier import load_classifier
from training.scenes import ATTRIBUTES, Colour, Scene, scene_at
from uploads.images import InputImage, normalise, normalise_mask
from workers.families import built_in_for, family_of
from workers.queue.records import Records
from workers.queue.schema import KindField, RequestRecord
from workers.queue.served_model import Workflow, request_defaults
from workers.queue.submit import new_request_id, submit
from workers.stages.media import encode_frames

SEED = 800  # the input scenes' dataset seed: no other bench's, the model's or the classifier's
STRENGTHS = {"image-to-image": (0.6, 0.8), "inpainting": (0.8, 1.0)}
SHAPES_MODEL = ("image-to-image", "inpainting")  # the workflows the shapes model serves
EDITING_MODEL = ("instruction editing",)
MASK_MARGIN = 3  # pixels the inpainting mask's box reaches past the shape's
ANIMATED_FROM = 1000  # the animated scenes' first index: none of them is also edited
MOTIONS = ("the shape drifts slowly to the left", "the shape spins in place",
           "the camera zooms in on the shape", "the background fades to black",
           "the shape bounces up and down")
TENANT = "bench"


@dataclass(frozen=True, slots=True)
class Edit:
    """One request: a scene's render (and, to inpaint, the mask over its shape), and the scene
    its prompt asks for (recoloured, for an edit; the same scene, for an animation)."""

    workflow: str
    source: Scene
    image: Image.Image
    mask: Image.Image | None
    target: Scene
    spec: GenerationSpec


def kept(cache: TensorCache, image: Image.Image, mask: bool = False) -> InputImage:
    """Put ``image`` in the store as ``POST /v1/images`` keeps it (``?kind=mask`` for a
    ``mask``)."""
    png = io.BytesIO()
    image.save(png, format="PNG")
    normalised = (normalise_mask if mask else normalise)(png.getvalue(), 2**20, 2**20)
    cache.put(image_key(TENANT, normalised.hash),
              torch.frombuffer(bytearray(normalised.png), dtype=torch.uint8))
    return normalised


def shape_mask(scene: Scene) -> Image.Image:
    """White over the box of ``scene``'s shape (and ``MASK_MARGIN`` around it), black
    elsewhere: the place an inpainting repaints."""
    render = scene.render()
    mask = Image.new("L", render.size, 0)
    cx = scene.position.value[0] * render.width + scene.jitter[0]
    cy = scene.position.value[1] * render.height + scene.jitter[1]
    reach = scene.size.value + MASK_MARGIN
    ImageDraw.Draw(mask).rectangle((cx - reach, cy - reach, cx + reach, cy + reach), fill=255)
    return mask


@dataclass(frozen=True, slots=True)
class Target:
    """What one edit asks of a scene: its shape in ``colour``, by ``workflow`` (one of
    ``SHAPES_MODEL`` or ``EDITING_MODEL``) at ``strength`` (none for instruction editing,
    which takes no strength)."""

    colour: Colour
    strength: float | None
    workflow: str = "image-to-image"


def recoloured(settings: Settings, cache: TensorCache, scene: Scene, targets: list[Target],
               first_seed: int) -> list[Edit]:
    """``scene``'s render (and, if one of ``targets`` inpaints, its shape's mask), kept, then
    edited into each of ``targets``."""
    m = request_defaults(settings.model, settings.model_dir)
    render = scene.render()
    image = kept(cache, render).hash
    mask = None
    if any(t.workflow == "inpainting" for t in targets):
        mask = kept(cache, shape_mask(scene), mask=True)
        with Image.open(io.BytesIO(mask.png)) as opened:  # as the pipeline is given it
            mask_pixels = opened.copy()
    edits = []
    for n, target in enumerate(targets):
        asked = dataclasses.replace(scene, colour=target.colour)
        inpaint = mask if target.workflow == "inpainting" else None
        prompt = (f"make the {scene.shape.value} {target.colour.name.lower()}"
                  if target.workflow == "instruction editing" else asked.caption)
        spec = GenerationSpec.create(
            request_id=new_request_id(), tenant=TENANT, prompt=prompt, width=m.width,
            height=m.height, num_frames=1, num_inference_steps=m.num_inference_steps,
            guidance_scale=m.guidance_scale, seed=first_seed + n,
            output_format=OutputFormat.NPY,
            image=ImageInput(image, target.strength, inpaint.hash if inpaint else None))
        edits.append(Edit(target.workflow, scene, render, mask_pixels if inpaint else None,
                          asked, spec))
    return edits


def other_colours(scene: Scene) -> list[Colour]:
    """The colours neither its shape nor its background has: six of the eight."""
    return [c for c in Colour if c not in (scene.colour, scene.background)]


def workload(settings: Settings, cache: TensorCache, images: int, workflows: tuple[str, ...]
             ) -> list[Edit]:
    """Each scene edited into each of its other colours, every other one by
    ``EDITING_MODEL``'s workflows and the rest by ``SHAPES_MODEL``'s, in turn: the edits of
    ``workflows`` (those of the model that ``settings`` serves)."""
    edits: list[Edit] = []
    for index in range(images):
        chosen = EDITING_MODEL if index % 2 else SHAPES_MODEL
        if chosen != workflows:
            continue
        scene = scene_at(SEED, index)
        targets = []
        for n, colour in enumerate(other_colours(scene)):
            workflow = chosen[n % len(chosen)]
            # Each workflow's strengths in turn, from image to image.
            strengths = STRENGTHS.get(workflow, (None,))
            strength = strengths[(n // len(chosen) + index // 2) % len(strengths)]
            targets.append(Target(colour, strength, workflow))
        edits += recoloured(settings, cache, scene, targets, 1000 + len(Colour) * index)
    return edits


def animations(settings: Settings, cache: TensorCache, images: int) -> list[Edit]:
    """Renders of other held-out scenes, kept, each animated by every one of ``MOTIONS``."""
    m = request_defaults(settings.model, settings.model_dir)
    clips: list[Edit] = []
    for index in range(images):
        scene = scene_at(SEED, ANIMATED_FROM + index)
        render = scene.render()
        image = kept(cache, render).hash
        for motion in MOTIONS:
            spec = GenerationSpec.create(
                request_id=new_request_id(), tenant=TENANT, prompt=f"{scene.caption}, {motion}",
                width=m.width, height=m.height, num_frames=m.frames(True),
                num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
                seed=2000 + len(clips), output_format=OutputFormat.NPY,
                image=ImageInput(image, strength=None))
            clips.append(Edit("image-to-video", scene, render, None, scene, spec))
    return clips


def run_baseline(settings: Settings, edits: list[Edit], threads: int | None = None
                 ) -> tuple[float, list[np.ndarray]]:
    """Seconds for the served family's monolithic pipeline to serve ``edits`` one after
    another, and its frames; with ``threads``, torch runs that many per op."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        pipeline = family_of(settings.model_dir).reference(settings.model_dir,
                                                           placement_of(settings))
        start = time.perf_counter()
        frames = []
        for edit in edits:
            frames.append(pipeline(edit.spec, edit.image, edit.mask))
            encode_frames([frames[-1]], OutputFormat.NPY, settings.workers.fps)
        return time.perf_counter() - start, frames
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True, slots=True)
class Served:
    """One workflow's requests served both ways."""

    records: list[RequestRecord]
    frames: list[np.ndarray]
    baseline_s: float
    diffcache_s: float
    identical: bool  # a sample of outputs against the pipeline's, one thread per op


def serve(settings: Settings, cache: TensorCache, edits: list[Edit], sample: int) -> Served:
    """``edits`` through the pipeline one after another, then through the three workers all
    submitted at once."""
    records = Records(open_redis(settings))
    baseline_s, _ = run_baseline(settings, edits)
    with workers(settings, settings.data_dir / "logs"):
        start = time.perf_counter()
        for edit in edits:
            submit(records.redis, edit.spec)
        done, frames = collect(records, cache, [e.spec for e in edits])
        diffcache_s = time.perf_counter() - start
    chosen = edits[:: max(1, len(edits) // sample)][:sample]
    _, expected = run_baseline(settings, chosen, threads=1)
    identical = all(np.array_equal(frames[edits.index(e)], want)
                    for e, want in zip(chosen, expected, strict=True))
    return Served(done, frames, baseline_s, diffcache_s, identical)


def image_encodes(records: list[RequestRecord], kind: KeyKind = KeyKind.IMAGE_LATENT
                  ) -> tuple[int, int]:
    """Lookups of condition-image encodings (or, by ``kind``, of masks or of instructions read
    with their image), and how many of them missed (an encode)."""
    lookups = sum(r.per_kind(KindField.LOOKUPS).get(kind.value, 0) for r in records)
    hits = sum(r.hits().get(kind.value, 0) for r in records)
    return lookups, lookups - hits


def readings(frames: np.ndarray, edits: list[Edit]
             ) -> dict[tuple[str, float], tuple[int, float, float]]:
    """Per workflow and strength: how many outputs, the share the classifier reads in the
    colour asked for, and the share with the input's shape."""
    read = load_classifier().read(frames)
    colours, shapes = ATTRIBUTES["color"], ATTRIBUTES["shape"]
    out = {}
    for workflow, strengths in STRENGTHS.items():
        for strength in strengths:
            at = [i for i, e in enumerate(edits) if e.workflow == workflow
                  and e.spec.image is not None and e.spec.image.strength == strength]
            if not at:
                continue
            asked = np.mean([read["color"][i] == colours.index(edits[i].target.colour)
                             for i in at])
            shape = np.mean([read["shape"][i] == shapes.index(edits[i].source.shape)
                             for i in at])
            out[workflow, strength] = (len(at), round(float(asked), 3), round(float(shape), 3))
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--images", type=int, default=10, help="images edited")
    parser.add_argument("--animated", type=int, default=4, help="images animated")
    parser.add_argument("--sample", type=int, default=6, help="outputs of each model "
                        "compared with the pipeline's, one thread per op")
    args = parser.parse_args()
    with model_stack(model={"preset": "shapes"}) as settings:
        cache = open_cache(settings)
        edits = workload(settings, cache, args.images, SHAPES_MODEL)
        edited = serve(settings, cache, edits, args.sample)
        cache.close()
    with model_stack(family=built_in_for(Workflow.INSTRUCTION_EDIT).name) as settings:
        cache = open_cache(settings)
        instructions = workload(settings, cache, args.images, EDITING_MODEL)
        instructed = serve(settings, cache, instructions, args.sample)
        cache.close()
    with model_stack(family=built_in_for(Workflow.IMAGE_TO_VIDEO).name) as settings:
        cache = open_cache(settings)
        clips = animations(settings, cache, args.animated)
        animated = serve(settings, cache, clips, args.sample)
        cache.close()

    everything = (edited, instructed, animated)
    lookups, encodes = image_encodes([r for s in everything for r in s.records])
    requests = len(edits) + len(instructions) + len(clips)
    baseline_s = sum(s.baseline_s for s in everything)
    diffcache_s = sum(s.diffcache_s for s in everything)
    result = {"bench": "image_inputs", "requests": requests, "image_encodes": encodes,
              "image_encode_hit_rate": round(1 - encodes / lookups, 4) if lookups else 0.0,
              "identical": all(s.identical for s in everything),
              "throughput_ratio": round(baseline_s / diffcache_s, 4)}
    rows: list[list[object]] = []
    for name, pipeline, served, count in [
            ("edits", "image-to-image and inpainting pipelines", edited, len(edits)),
            ("instruction edits", built_in_for(Workflow.INSTRUCTION_EDIT).pipeline_class,
             instructed, len(instructions)),
            ("image-to-video", built_in_for(Workflow.IMAGE_TO_VIDEO).pipeline_class, animated,
             len(clips))]:
        rows += [[f"{name}: baseline ({pipeline}), one after another", served.baseline_s,
                  count / served.baseline_s, "", "", ""],
                 [f"{name}: diffcache (3 stage workers), all submitted at once",
                  served.diffcache_s, count / served.diffcache_s,
                  round(served.baseline_s / served.diffcache_s, 3), "", ""],
                 [f"{name}: image encodes, identical sample", image_encodes(served.records)[1],
                  "", served.identical, "", ""]]
    masks, mask_encodes = image_encodes(edited.records, KeyKind.IMAGE_MASK)
    rows.append(["inpainting: mask lookups, masks made", masks, "", mask_encodes, "", ""])
    read, made = image_encodes(instructed.records, KeyKind.IMAGE_EMBEDDING)
    rows.append(["instruction edits: instructions (and negatives) read with their image, made",
                 read, "", made, "", ""])
    rows += [[f"{workflow} at strength {strength}", count, "", "", asked, shape]
             for (workflow, strength), (count, asked, shape) in readings(
                 np.concatenate(edited.frames), edits).items()]
    report(f"{len(edits) + len(instructions)} edits (image-to-image, inpainting and "
           f"instruction editing) on {args.images} images, "
           f"{len(clips)} image-to-video requests on {args.animated}",
           ["run", "seconds or count", "requests/s", "ratio or identical", "colour asked",
            "shape kept"], rows, result)


if __name__ == "__main__":
    main()
