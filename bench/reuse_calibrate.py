"""Measure the table that turns a similarity into reused steps for approximate reuse, with the
quality yardstick, on the shipped shapes model; ``--write`` puts it in the model's card.

Each scene's caption is a source; its other prompts (``bench.reuse_trace``: rewordings, left
out size or position, a changed colour) and the next scene's caption are targets. A target
runs exactly (its own seed), and rewritten at each candidate fraction f of the steps (the
source's first f·N steps, its seed, then the target's prompt). The classifier reads every
output. Pairs are split into similarity bands at the quantiles of their similarities; a band
earns the largest f whose accuracy on the target's attributes stays within ``--tolerance`` of
the band's exact runs, and no band earns more than a more similar one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.common import model_stack, report, serve, workers
from bench.reuse_trace import TracePrompt, correct, variants
from cachesvc.connect import open_cache, open_redis
from encoders.text import prompt_vector
from keys import GenerationSpec, OutputFormat, PromptSegment
from training.classifier import load_classifier
from workers.families import family_of
from workers.families.base import CPU
from workers.queue.records import Records
from workers.queue.served_model import MODEL_CARD, request_defaults
from workers.queue.submit import new_request_id

SHIPPED_CARD = Path(__file__).parents[1] / "workers" / "families" / "trained" / "shapes" \
    / MODEL_CARD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenes", type=int, default=24)
    parser.add_argument("--first", type=int, default=1000, help="the first scene's index: "
                        "apart from bench.reuse's scenes (0 to 39), so the table is not "
                        "measured on the trace it is judged on")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
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

        text = family_of(settings.model_dir).text_encoder(settings.model_dir, CPU)
        pairs: list[tuple[TracePrompt, TracePrompt]] = []
        for i in range(args.first, args.first + args.scenes):
            source, *others = variants(i)
            # Its own rewordings, and the next scene's caption: a neighbour the index may
            # return in a bucket of many scenes, which the table must price too.
            pairs += [(source, other) for other in others]
            pairs.append((source, variants(i + 1)[0]))
        similarity = np.array([float(prompt_vector(text, s.prompt) @ prompt_vector(text, t.prompt))
                               for s, t in pairs])
        records, cache = Records(open_redis(settings)), open_cache(settings)
        sources = {s.prompt: spec(s.prompt, 10_000 + n) for n, (s, _) in enumerate(pairs)}
        targets = [spec(t.prompt, 20_000 + n) for n, (_, t) in enumerate(pairs)]
        asked = [t.scene for _, t in pairs]
        with workers(settings, settings.data_dir / "logs"):
            serve(records, cache, list(sources.values()))
            _, exact = serve(records, cache, targets)
            scores = {0.0: correct(classifier, np.concatenate(exact), asked).mean(axis=1)}
            for f in args.fractions:
                k = round(f * steps)
                rewritten = [sources[s.prompt].branch(
                    new_request_id(), k, (PromptSegment(t.prompt, "", steps),))
                    for s, t in pairs]
                _, frames = serve(records, cache, rewritten)
                scores[f] = correct(classifier, np.concatenate(frames), asked).mean(axis=1)
        cache.close()
    edges = np.quantile(similarity, np.linspace(0, 1, args.bands + 1))
    rows, table = [], []
    earned_above = max(args.fractions)
    for b in reversed(range(args.bands)):  # from the most similar band down
        inside = (similarity >= edges[b]) & (similarity <= edges[b + 1])
        base = float(scores[0.0][inside].mean())
        passing = [f for f in args.fractions
                   if float(scores[f][inside].mean()) >= base - args.tolerance]
        earned = min(max(passing, default=0.0), earned_above)
        earned_above = earned
        table.append([round(float(edges[b]), 4), earned])
        rows.append([f"{edges[b]:.3f} to {edges[b + 1]:.3f}", int(inside.sum()), base,
                     *(float(scores[f][inside].mean()) for f in args.fractions), earned])
    table.reverse()
    rows.reverse()
    if args.write:
        card = json.loads(SHIPPED_CARD.read_text())
        card["model"]["reuse_table"] = table
        SHIPPED_CARD.write_text(json.dumps(card, indent=1) + "\n")
    report(f"shapes model, {len(pairs)} (source, target) prompt pairs: accuracy on the "
           f"target's attributes, exact and rewritten at each fraction of {steps} steps",
           ["similarity", "pairs", "exact", *(f"f={f}" for f in args.fractions), "earned"],
           rows, {"bench": "reuse_calibrate", "pairs": len(pairs), "reuse_table": table,
                  "tolerance": args.tolerance})


if __name__ == "__main__":
    main()
