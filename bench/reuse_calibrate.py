"""Measure the table that turns a similarity into reused steps for approximate reuse, with the
quality yardstick, on the shipped shapes model; ``--write`` puts it in the model's card.

First the vector: each view of a prompt (``workers/stages/prompt_view.py``) is scored, per
changed attribute, by the share of rewordings more similar to their captions than any prompt
with that attribute changed is to its own; the view best on its worst attribute is kept.

Then the pairs: every scene's caption with each of its other prompts, both ways (a prompt's
nearest neighbours in the index are mostly its own scene's), and each caption with the previous
scene's. A pair's target runs exactly from its source's seed, and rewritten at each fraction f
of the steps (the source's first f·N steps, then the target's prompt). A rewritten output is
reuse-made wrong where it shows an attribute other than asked that the exact run from the same
seed shows as asked: the reused steps decided it, not the seed.

The table: for each fraction f from ``--least`` up, the least similarity above which no pair
whose prompts differ in an attribute went reuse-made wrong at f or a smaller fraction, its
distance to 1 (that of the most similar such pair) cut by ``--margin`` so that unseen pairs
near the edge stay below it; and above which pairs asking for the same attributes went wrong
at most ``--tolerance`` of the time. A larger fraction never takes a smaller similarity. Below
``--least`` no fraction is offered: what the first steps decide (colour, background, position)
is what a changed prompt changes, and they save little.

Last, the agreement a reused step must show (``reuse_agreement``): at each pair's step of each
fraction, on the source's own latents there (its stored checkpoint), the cosine of what the two
prompts do to the prediction (``PromptEffect.agreement``). Pairs whose prompts differ in an
attribute that the reuse made wrong agree less than rewordings do; the least agreement asked
is the highest such pair's, its distance to 1 cut by ``--agreement-margin``. A step in reach
that agrees less is too late to switch prompts: the search takes an earlier one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.common import bench_parser, model_stack, print_table, report, serve, workers
from bench.reuse_trace import CHANGES, SAME, TracePrompt, reuse_induced, variants
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from encoders.text import ImageTextModel, prompt_vector
from keys import GenerationSpec, OutputFormat, PromptSegment, StoreKey
from training.classifier import load_classifier
from workers.engine.checkpoint import Checkpoint
from workers.families import family_of
from workers.families.base import CPU
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.served_model import MODEL_CARD, request_defaults
from workers.queue.submit import new_request_id
from workers.stages.prompt_view import VIEWS, PromptEffect, prompt_view

SHIPPED_CARD = Path(__file__).parents[1] / "workers" / "families" / "trained" / "shapes" \
    / MODEL_CARD


def separation(prompts: list[TracePrompt], groups: list[int], vectors: np.ndarray
               ) -> dict[str, float]:
    """Per changed attribute: the share of rewordings (each against its scene's caption) more
    similar than every prompt with that attribute changed (each against its own caption),
    over all scenes: the rewordings a table can let reuse many steps while no changed
    attribute reaches them."""
    similarity = vectors @ vectors.T
    captions = {g: i for i, (p, g) in enumerate(zip(prompts, groups, strict=True))
                if p.variant == "caption"}
    same: list[float] = []
    changed: dict[str, list[float]] = {}
    for i, (p, g) in enumerate(zip(prompts, groups, strict=True)):
        if p.variant == "caption":
            continue
        s = float(similarity[captions[g], i])
        (same.append(s) if p.variant in SAME else changed.setdefault(p.variant, []).append(s))
    rewordings = np.array(same)
    return {attribute: float((rewordings > max(s)).mean()) for attribute, s in changed.items()}


def pairs_of(prompts: list[TracePrompt], groups: list[int]) -> list[tuple[int, int]]:
    """(source, target) positions: each caption with its scene's other prompts, both ways,
    and with the previous scene's caption."""
    captions = [i for i, p in enumerate(prompts) if p.variant == "caption"]
    pairs = []
    for c in captions:
        for i in (i for i, g in enumerate(groups) if g == groups[c] and i != c):
            pairs += [(c, i), (i, c)]
    return pairs + list(zip(captions, captions[1:] + captions[:1], strict=True))


def table_of(similarity: np.ndarray, differ: np.ndarray, wrong: dict[float, np.ndarray],
             least: float, margin: float, tolerance: float) -> list[tuple[float, float]]:
    """(least similarity, fraction) rows, as the module's docstring says."""
    fractions = sorted(f for f in wrong if f >= least)
    wrong_by = np.zeros(len(similarity), dtype=bool)  # at this fraction or a smaller one
    for f in sorted(f for f in wrong if f < least):
        wrong_by |= wrong[f]
    rows: list[tuple[float, float]] = []
    edge = -1.0
    for f in fractions:
        wrong_by = wrong_by | wrong[f]
        bad = differ & wrong_by
        if bad.any():
            edge = max(edge, 1 - (1 - float(similarity[bad].max())) / margin)
        same = ~differ & (similarity >= edge)
        while same.any() and float(wrong_by[same].mean()) > tolerance:
            edge = float(np.nextafter(similarity[same].min(), 2.0))
            same = ~differ & (similarity >= edge)
        if rows and rows[-1][0] == round(edge, 5):
            rows[-1] = (rows[-1][0], f)  # the same edge earns the larger fraction
        elif edge <= 1.0:
            rows.append((round(edge, 5), f))
    return rows


def choose_view(directory: Path, prompts: list[TracePrompt], groups: list[int],
                shape: GenerationSpec) -> tuple[str, dict[str, dict[str, float]], np.ndarray]:
    """The view best on its worst attribute, each view's separation, and the chosen view's
    vectors of ``prompts``. (The prompt-effect view also measures agreement: ``agreements``.)
    """
    family = family_of(directory)
    text = family.text_encoder(directory, CPU)
    if isinstance(text, ImageTextModel):
        raise SystemExit(f"{family.name} reads its prompts with an image: approximate reuse, "
                         "and its calibration, take text-only models")
    denoiser = family.denoiser(directory, CPU)
    apart: dict[str, dict[str, float]] = {}
    vectors: dict[str, np.ndarray] = {}
    for name in VIEWS:
        view = prompt_view(name, lambda: denoiser, lambda: text.encode(text.tokenize("")))
        vectors[name] = np.stack([prompt_vector(text, view, p.prompt, shape) for p in prompts])
        apart[name] = separation(prompts, groups, vectors[name])
    chosen = max(apart, key=lambda k: min(apart[k].values()))
    return chosen, apart, vectors[chosen]


def run_pairs(prompts: list[TracePrompt], at: list[tuple[int, int]],
              fractions: list[float]
              ) -> tuple[np.ndarray, dict[float, np.ndarray], dict[float, np.ndarray]]:
    """Each pair's target exactly from its source's seed, and rewritten at each fraction:
    their outputs, in ``at``'s order; and at each fraction's step, how well the two prompts
    agree on the source's latents there (``agreements``)."""
    with model_stack(model={"preset": "shapes"}) as settings:
        m = request_defaults(settings.model, settings.model_dir)

        def spec(prompt: str, seed: int) -> GenerationSpec:
            return GenerationSpec.create(
                request_id=new_request_id(), tenant="calibrate", prompt=prompt,
                width=m.width, height=m.height, num_frames=1,
                num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
                seed=seed, output_format=OutputFormat.NPY)

        records, cache = Records(open_redis(settings)), open_cache(settings)
        sources = [spec(p.prompt, 10_000 + n) for n, p in enumerate(prompts)]
        outputs = {}
        with workers(settings, settings.data_dir / "logs"):
            served, _ = serve(records, cache, sources)
            agreed = agreements(settings.model_dir, cache, prompts, served, at, fractions)
            _, exact = serve(records, cache, [spec(prompts[t].prompt, sources[s].seed)
                                              for s, t in at])
            for f in fractions:
                k = round(f * m.num_inference_steps)
                _, branched = serve(records, cache, [sources[s].branch(
                    new_request_id(), k, (PromptSegment(prompts[t].prompt, "",
                                                        m.num_inference_steps),))
                    for s, t in at])
                outputs[f] = np.concatenate(branched)
        cache.close()
    return np.concatenate(exact), outputs, agreed


def agreements(directory: Path, cache: TensorCache, prompts: list[TracePrompt],
               sources: list[RequestRecord], at: list[tuple[int, int]],
               fractions: list[float]) -> dict[float, np.ndarray]:
    """Per fraction, per pair: how alike the source's and the target's prompts pull the
    prediction on the source's latents at the fraction's step (its stored checkpoint)."""
    family = family_of(directory)
    text = family.text_encoder(directory, CPU)
    assert not isinstance(text, ImageTextModel)
    view = PromptEffect(family.denoiser(directory, CPU), lambda: text.encode(text.tokenize("")))
    embedded = {p.prompt: text.encode(text.tokenize(p.prompt)) for p in prompts}
    out = {}
    for f in fractions:
        values = []
        for s, t in at:
            record = sources[s]
            k = round(f * record.spec.num_inference_steps)
            data = cache.get(StoreKey.parse(record.checkpoints()[k]), lookup=False)
            assert data is not None, f"checkpoint {k} of {record.spec.request_id} is gone"
            latents = Checkpoint.from_bytes(data.numpy().tobytes()).latents
            values.append(view.agreement(latents, k, embedded[prompts[t].prompt],
                                         embedded[prompts[s].prompt], record.spec))
        out[f] = np.array(values)
    return out


def least_agreement(agreed: dict[float, np.ndarray], differ: np.ndarray,
                    wrong: dict[float, np.ndarray], least: float, margin: float) -> float:
    """The agreement a reused step must show: the highest of the pairs whose prompts differ
    in an attribute that the reuse made wrong, at a fraction the table may earn, its
    distance to 1 cut by ``margin``."""
    highest = max((float(agreed[f][differ & wrong[f]].max()) for f in agreed
                   if f >= least and (differ & wrong[f]).any()), default=-1.0)
    return round(1 - (1 - highest) / margin, 4)


def _checked_fraction(table: list[tuple[float, float]], agreed: dict[float, np.ndarray],
                      least: float, n: int, similarity: float) -> float:
    """The fraction pair ``n`` earns, as the service finds it: the largest the table gives
    its similarity whose step agrees enough, else a smaller one."""
    offered = sorted((f for edge, f in table if similarity >= edge), reverse=True)
    reachable = sorted((f for f in agreed if f <= (offered[0] if offered else 0.0)),
                       reverse=True)
    return next((f for f in reachable if agreed[f][n] >= least), 0.0)


def kind(source: TracePrompt, target: TracePrompt) -> str:
    """``same``, the one attribute the target changed, or ``scene`` for several."""
    mine, theirs = target.scene.labels(), source.scene.labels()
    changed = [a for a in mine if mine[a] != theirs[a]]
    return "same" if not changed else changed[0] if len(changed) == 1 else "scene"


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--scenes", type=int, default=48)
    parser.add_argument("--first", type=int, default=1000, help="the first scene's index: "
                        "apart from bench.reuse's scenes (0 to 39), so the table is not "
                        "measured on the trace it is judged on")
    parser.add_argument("--fractions", type=float, nargs="+",
                        default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
                        help="of the steps: each must land on a stored checkpoint (every "
                        "other step of the shipped model's 20), where reuse can start")
    parser.add_argument("--least", type=float, default=0.4)
    parser.add_argument("--margin", type=float, default=3.0)
    # A pair asking for the same attributes goes wrong past half the steps only where the
    # source's own seed drew it wrong (its later steps decide what the new prompt no longer
    # can): 1 of 288 at 0.5, 2 or 3 from 0.6 on, on the shipped model. Past this share a
    # fraction waits for a higher similarity, so a rewording rarely inherits such a mistake.
    parser.add_argument("--tolerance", type=float, default=0.004)
    parser.add_argument("--agreement-margin", type=float, default=1.5)
    parser.add_argument("--save", type=Path, help="an .npz of every pair's similarity, kind, "
                        "agreements and reuse-made wrong outputs, to study the rules again")
    parser.add_argument("--write", action="store_true", help=f"write the table to {SHIPPED_CARD}")
    args = parser.parse_args()
    classifier = load_classifier()
    scenes = range(args.first, args.first + args.scenes)
    prompts = [p for i in scenes for p in variants(i, CHANGES)]
    groups = [i for i in scenes for _ in variants(i, CHANGES)]
    shape = GenerationSpec.create(request_id="shape", tenant="calibrate", prompt="", width=32,
                                  height=32, num_frames=1, num_inference_steps=20,
                                  guidance_scale=4.0, seed=0, output_format=OutputFormat.NPY)
    chosen, apart, vectors = choose_view(SHIPPED_CARD.parent, prompts, groups, shape)
    at = pairs_of(prompts, groups)
    similarity = np.array([float(vectors[s] @ vectors[t]) for s, t in at])
    exact, outputs, agreed = run_pairs(prompts, at, args.fractions)
    asked = [prompts[t].scene for _, t in at]
    wrong = {f: reuse_induced(classifier, out, exact, asked) for f, out in outputs.items()}
    kinds = np.array([kind(prompts[s], prompts[t]) for s, t in at])
    differ = kinds != "same"
    table = table_of(similarity, differ, wrong, args.least, args.margin, args.tolerance)
    agreement = least_agreement(agreed, differ, wrong, args.least, args.agreement_margin)
    if args.save is not None:
        arrays: dict[str, np.ndarray] = {"similarity": similarity, "kinds": kinds}
        arrays |= {f"wrong_{f}": w for f, w in wrong.items()}
        arrays |= {f"agreed_{f}": a for f, a in agreed.items()}
        np.savez(args.save, **arrays)  # type: ignore[arg-type]
    if args.write:
        card = json.loads(SHIPPED_CARD.read_text())
        card["model"]["reuse_table"] = [list(row) for row in table]
        card["model"]["reuse_vector"] = chosen
        card["model"]["reuse_agreement"] = agreement
        SHIPPED_CARD.write_text(json.dumps(card, indent=1) + "\n")
    print_table("Rewordings more similar than every prompt with the attribute changed",
                ["view", *CHANGES],
                [[name, *(f"{by[a]:.3f}" for a in CHANGES)] for name, by in apart.items()])
    names = ["same", *CHANGES, "scene"]
    print_table(f"Reuse-made wrong outputs per kind of pair ({chosen}), of all pairs",
                ["fraction", *names],
                [[f"f={f}", *(f"{int(wrong[f][kinds == k].sum())}/{int((kinds == k).sum())}"
                              for k in names)] for f in args.fractions])
    earned = [_checked_fraction(table, agreed, agreement, n, s)
              for n, s in enumerate(similarity)]
    report(f"shapes model, {len(at)} (source, target) pairs: the table ({chosen})",
           ["least similarity", "fraction", "same pairs at or above",
            "changed pairs at or above"],
           [[edge, f, int(((similarity >= edge) & ~differ).sum()),
             int(((similarity >= edge) & differ).sum())] for edge, f in table],
           {"bench": "reuse_calibrate", "pairs": len(at), "reuse_table": table,
            "reuse_vector": chosen, "reuse_agreement": agreement, "least": args.least,
            "margin": args.margin, "tolerance": args.tolerance,
            "wrong_at_earned": int(sum(bool(wrong[f][i]) for i, f in enumerate(earned) if f)),
            "mean_fraction_same": round(float(np.mean(np.array(earned)[~differ])), 3)})


if __name__ == "__main__":
    main()
