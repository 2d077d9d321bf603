"""Measure the table that turns a similarity into reused steps for approximate reuse, with the
quality yardstick, on the shipped shapes model; ``--write`` puts it in the model's card.

First the vector: each view of a prompt (``workers/stages/prompt_view.py``: the text encoder's
mean, the denoiser's first prediction) is scored by how well it tells a prompt's rewordings
from the prompt with one attribute changed (``bench.reuse_trace``'s five prompts per scene:
rewordings, a left-out size or position, a changed colour), and the best is kept. Then the
pairs the index returns in that view: every prompt is a target with its nearest other prompt as
its source, and each scene's caption is a target of the previous scene's caption (a neighbour
from another scene).

A target runs exactly (its own seed), and rewritten at each candidate fraction f of the steps
(the source's first f·N steps, its seed, then the target's prompt). The classifier reads every
output. Pairs are split into similarity bands at the quantiles of their similarities; a band
earns the largest f which, with every smaller one, keeps the accuracy on the target's
attributes within ``--tolerance`` of the band's exact runs, and its share of outputs showing the
source's attributes where the target asked for others (a leaked colour) within the same
tolerance of the exact runs' share; no band earns more than a more similar one.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from bench.common import model_stack, print_table, report, serve, workers
from bench.reuse_trace import TracePrompt, correct, variants
from cachesvc.connect import open_cache, open_redis
from encoders.text import ImageTextModel, prompt_vector
from keys import GenerationSpec, OutputFormat, PromptSegment
from training.classifier import AttributeClassifier, load_classifier
from training.scenes import Scene
from workers.families import family_of
from workers.families.base import CPU
from workers.queue.records import Records
from workers.queue.served_model import MODEL_CARD, request_defaults
from workers.queue.submit import new_request_id
from workers.stages.prompt_view import VIEWS, prompt_view

SHIPPED_CARD = Path(__file__).parents[1] / "workers" / "families" / "trained" / "shapes" \
    / MODEL_CARD


def leaked(classifier: AttributeClassifier, frames: np.ndarray, asked: list[Scene],
           theirs: list[Scene]) -> np.ndarray:
    """Per output: whether it shows an attribute of the source's where the request asked for
    another value (a wrong colour taken from the neighbour)."""
    read = classifier.read(frames)
    out = []
    for i, (want, source) in enumerate(zip(asked, theirs, strict=True)):
        mine, other = want.labels(), source.labels()
        out.append(any(mine[a] != other[a] and int(read[a][i]) == other[a] for a in read))
    return np.array(out)


def bands(similarity: np.ndarray, scores: dict[float, np.ndarray],
          leaks: dict[float, np.ndarray], fractions: list[float], count: int,
          tolerance: float) -> tuple[list[list[object]], list[list[float]]]:
    """The report's rows and the table: ``count`` bands at the similarity's quantiles, from
    the most similar down, each earning what the module's docstring says."""
    edges = np.quantile(similarity, np.linspace(0, 1, count + 1))
    rows, table = [], []
    earned_above = max(fractions)
    for b in reversed(range(count)):  # from the most similar band down
        # Half-open as the table is read (a band from its least similarity up to the next
        # band's), so a pair at an edge counts once, in the band that serves it.
        inside = (similarity >= edges[b]) & ((similarity < edges[b + 1]) | (b == count - 1))
        base = float(scores[0.0][inside].mean())
        # The largest fraction that, with every smaller one, keeps the band's accuracy within
        # the tolerance and its share of outputs showing the source's attributes (where the
        # request asked for others) within the same tolerance of the exact runs' share: one
        # misread output in a band must not decide it, as it does not decide the accuracy.
        earned = 0.0
        leaked_exact = float(leaks[0.0][inside].mean())
        for f in sorted(fractions):
            if float(scores[f][inside].mean()) < base - tolerance or \
                    float(leaks[f][inside].mean()) > leaked_exact + tolerance:
                break
            earned = f
        earned = min(earned, earned_above)
        earned_above = earned
        table.append([round(float(edges[b]), 4), earned])
        rows.append([f"{edges[b]:.4f} to {edges[b + 1]:.4f}", int(inside.sum()),
                     f"{base:.3f} ({int(leaks[0.0][inside].sum())})",
                     *(f"{float(scores[f][inside].mean()):.3f} ({int(leaks[f][inside].sum())})"
                       for f in fractions), earned])
    table.reverse()
    rows.reverse()
    return rows, table


def separation(prompts: list[TracePrompt], groups: list[int], vectors: np.ndarray) -> float:
    """How well a view tells a prompt's rewordings from the same prompt with one attribute
    changed: the share of (same attributes, changed attribute) pairs of one scene's prompts in
    which the first pair is the more similar (the area under the ROC curve); ``groups`` names
    each prompt's scene. A rewording is what may reuse many steps; a changed colour is what
    must not."""
    similarity = vectors @ vectors.T
    same: list[float] = []
    changed: list[float] = []
    for i, j in itertools.permutations(range(len(prompts)), 2):
        if groups[i] == groups[j]:
            (same if prompts[i].scene == prompts[j].scene else changed).append(similarity[i, j])
    return float((np.array(same)[:, None] > np.array(changed)[None, :]).mean())


def index_pairs(prompts: list[TracePrompt], similarity: np.ndarray) -> list[tuple[int, int]]:
    """(source, target) positions: each prompt with its nearest other prompt as its source,
    what the index returns in a bucket that holds them all (the same text passed over, as
    ``ApproximateReuse.find`` passes it over)."""
    similarity = similarity.copy()
    texts = [p.prompt for p in prompts]
    for i, text in enumerate(texts):
        similarity[i, [j for j, other in enumerate(texts) if other == text]] = -np.inf
    return [(int(np.argmax(similarity[t])), t) for t in range(len(prompts))]


def view_and_pairs(directory: Path, shape: GenerationSpec, first: int, count: int) -> tuple[
        str, dict[str, float], list[tuple[TracePrompt, TracePrompt]], np.ndarray]:
    """The view that best tells rewordings from changed attributes, each view's separation,
    and the (source, target) pairs to run in it with their similarities: the pairs the index
    returns, then caption to caption. ``shape`` is the requests' (their bucket's) shape."""
    family = family_of(directory)
    text = family.text_encoder(directory, CPU)
    if isinstance(text, ImageTextModel):
        raise SystemExit(f"{family.name} reads its prompts with an image: approximate reuse, "
                         "and its calibration, take text-only models")
    scenes = range(first, first + count)
    prompts = [p for i in scenes for p in variants(i)]
    groups = [i for i in scenes for _ in variants(i)]
    vectors = {}
    for name in VIEWS:
        view = prompt_view(name, lambda: family.denoiser(directory, CPU))
        vectors[name] = np.stack([prompt_vector(text, view, p.prompt, shape) for p in prompts])
    apart = {name: separation(prompts, groups, v) for name, v in vectors.items()}
    name = max(apart, key=lambda k: apart[k])
    similarity = vectors[name] @ vectors[name].T
    at = index_pairs(prompts, similarity)
    captions = [n for n, p in enumerate(prompts) if p.variant == "caption"]
    at += list(zip(captions, captions[1:] + captions[:1], strict=True))  # the last: the first's
    pairs = [(prompts[s], prompts[t]) for s, t in at]
    return name, apart, pairs, np.array([float(similarity[s, t]) for s, t in at])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenes", type=int, default=48)
    parser.add_argument("--first", type=int, default=1000, help="the first scene's index: "
                        "apart from bench.reuse's scenes (0 to 39), so the table is not "
                        "measured on the trace it is judged on")
    parser.add_argument("--fractions", type=float, nargs="+",
                        default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--write", action="store_true", help=f"write the table to {SHIPPED_CARD}")
    args = parser.parse_args()
    classifier = load_classifier()
    with model_stack(model={"preset": "shapes"}) as settings:
        m = request_defaults(settings.model, settings.model_dir)
        steps = m.num_inference_steps

        def spec(prompt: str, seed: int) -> GenerationSpec:
            return GenerationSpec.create(
                request_id=new_request_id(), tenant="calibrate", prompt=prompt,
                width=m.width, height=m.height, num_frames=1, num_inference_steps=steps,
                guidance_scale=m.guidance_scale, seed=seed, output_format=OutputFormat.NPY)

        view, apart, pairs, similarity = view_and_pairs(settings.model_dir, spec("", 0),
                                                        args.first, args.scenes)
        records, cache = Records(open_redis(settings)), open_cache(settings)
        sources = {s.prompt: spec(s.prompt, 10_000 + n) for n, (s, _) in enumerate(pairs)}
        targets = [spec(t.prompt, 20_000 + n) for n, (_, t) in enumerate(pairs)]
        asked = [t.scene for _, t in pairs]
        theirs = [s.scene for s, _ in pairs]
        scores, leaks = {}, {}
        with workers(settings, settings.data_dir / "logs"):
            serve(records, cache, list(sources.values()))
            _, exact = serve(records, cache, targets)
            outputs = {0.0: np.concatenate(exact)}
            for f in args.fractions:
                k = round(f * steps)
                rewritten = [sources[s.prompt].branch(
                    new_request_id(), k, (PromptSegment(t.prompt, "", steps),))
                    for s, t in pairs]
                _, branched = serve(records, cache, rewritten)
                outputs[f] = np.concatenate(branched)
        cache.close()
        for f, read in outputs.items():
            scores[f] = correct(classifier, read, asked).mean(axis=1)
            leaks[f] = leaked(classifier, read, asked, theirs)
    rows, table = bands(similarity, scores, leaks, args.fractions, args.bands,
                        args.tolerance)
    if args.write:
        card = json.loads(SHIPPED_CARD.read_text())
        card["model"]["reuse_table"] = table
        card["model"]["reuse_vector"] = view
        SHIPPED_CARD.write_text(json.dumps(card, indent=1) + "\n")
    print_table("How well each view tells a rewording from a changed attribute (ROC area)",
                ["view", "separation"],
                [[k, f"{v:.3f}"] for k, v in apart.items()])
    report(f"shapes model, {len(pairs)} (source, target) prompt pairs: accuracy on the "
           f"target's attributes, exact and rewritten at each fraction of {steps} steps",
           ["similarity", "pairs", "exact", *(f"f={f}" for f in args.fractions), "earned"],
           rows, {"bench": "reuse_calibrate", "pairs": len(pairs), "reuse_table": table,
                  "reuse_vector": view,
                  "tolerance": args.tolerance})


if __name__ == "__main__":
    main()
