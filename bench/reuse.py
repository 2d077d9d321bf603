"""Approximate reuse on a similarity-rich trace through the service, on the shipped shapes
model: 40 scenes, each asked six ways (``bench.reuse_trace``: its caption, two rewordings, one
with what is implied left out, and two with one attribute changed, the attributes in turn over
the scenes), every request with its own seed, in six waves (the captions, then each other
phrasing in turn, as similar prompts keep arriving). A wave arrives once the one before has
left the queue (its every request has begun to denoise), so the service has work throughout,
as under steady traffic; with ``--arrival served`` it waits until the one before is done. The
trace runs twice in one stack, once per mode, each in a tenant of its own.

Per mode: denoise forwards, throughput, and the classifier's accuracy on the attributes each
prompt asks for. Per kind of prompt (the same attributes, or one changed): the hits, the steps
reused, and the hits that reuse made wrong: an attribute other than asked where the same prompt
computed exactly from the same seed (the rewrite's, its source's; ``X-Diffcache-Effective-
Seed``) shows it as asked (``reuse_induced_wrong``); beside them, the hits wrong where the
request's own seed in exact mode is right, which counts the other seed's own mistakes too. A
sample of the rewritten requests is computed again from scratch (another tenant: no shared
checkpoint) and compared bit for bit.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np

from bench.common import (
    WAIT_ALL_S,
    bench_parser,
    collect,
    model_stack,
    print_table,
    report,
    serve,
    wait_all,
    workers,
)
from bench.reuse_trace import (
    SAME,
    TracePrompt,
    correct,
    reuse_induced,
    rotating_changes,
    variants,
)
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from keys import (
    DEFAULT_MAX_SKIP,
    GenerationSpec,
    OutputFormat,
    PromptSegment,
    Reuse,
    ReuseMode,
)
from training.classifier import load_classifier
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import RequestDefaults, request_defaults
from workers.queue.submit import new_request_id, submit

# One mode's pass over the trace: its seconds, records, outputs and the prompts asked, in order.
Run = tuple[float, list[RequestRecord], np.ndarray, list[TracePrompt]]
# A request in one of these states has left the queue for denoise.
BEGUN = frozenset({State.DENOISING, State.DENOISED, State.DECODING, State.DONE})


def wait_begun(records: Records, specs: list[GenerationSpec]) -> None:
    """Until every one of ``specs`` has begun to denoise; exits if one ended otherwise."""

    def begun() -> bool:
        states = records.states([(s.tenant, s.request_id) for s in specs])
        for spec, state in zip(specs, states, strict=True):
            if state is not None and state.terminal and state is not State.DONE:
                raise SystemExit(f"request {spec.request_id} ended {state.value}")
        return all(state in BEGUN for state in states)

    wait_until(begun, timeout_s=WAIT_ALL_S, interval_s=0.02,
               what=f"{len(specs)} requests begun denoising")


def trace_spec(m: RequestDefaults, tenant: str, reuse: Reuse, prompt: str,
               seed: int) -> GenerationSpec:
    return GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=prompt, width=m.width,
        height=m.height, num_frames=1, num_inference_steps=m.num_inference_steps,
        guidance_scale=m.guidance_scale, seed=seed, output_format=OutputFormat.NPY, reuse=reuse)


def run_trace(records: Records, cache: TensorCache, waves: list[list[TracePrompt]],
              arrival: str, spec: Callable[[str, int], GenerationSpec]) -> Run:
    """The waves through the service, each arriving as ``arrival`` says (every request with
    its own seed): the seconds from the first submission to the last output, the records and
    outputs in order, and the prompts asked."""
    submitted: list[GenerationSpec] = []
    previous: list[GenerationSpec] = []  # the wave before
    asked: list[TracePrompt] = []
    start = time.perf_counter()
    for w, wave in enumerate(waves):
        if previous:
            if arrival == "served":
                wait_all(records, previous)
            else:
                wait_begun(records, previous)
        previous = [spec(p.prompt, 30_000 + w * 1000 + n) for n, p in enumerate(wave)]
        for one in previous:
            submit(records.redis, one)
        submitted += previous
        asked += wave
    done, frames = collect(records, cache, submitted)
    return time.perf_counter() - start, done, np.concatenate(frames), asked


def exact_spec(tenant: str, prompt: str, like: GenerationSpec,
               schedule: tuple[PromptSegment, ...] | None = None) -> GenerationSpec:
    """``prompt`` (or ``schedule``) computed exactly, at ``like``'s geometry, steps and seed."""
    return GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=prompt, width=like.width,
        height=like.height, num_frames=1, num_inference_steps=like.num_inference_steps,
        guidance_scale=like.guidance_scale, seed=like.seed, output_format=OutputFormat.NPY,
        schedule=schedule)


def kind_of(prompt: TracePrompt) -> str:
    """The row of the per-kind table: the attribute a prompt changed, or ``reworded`` for one
    that asks for its scene's attributes in other words."""
    return "reworded" if prompt.variant in SAME else prompt.variant


def per_kind(asked: list[TracePrompt], records: list[RequestRecord], hits: list[int],
             induced: np.ndarray, own: np.ndarray) -> dict[str, dict[str, int]]:
    """Per kind of prompt: its requests, hits, steps reused, and the hits made wrong (by the
    reused steps, and against the request's own seed)."""
    by_kind: dict[str, dict[str, int]] = {}
    for prompt in asked:
        row = by_kind.setdefault(kind_of(prompt), dict.fromkeys(
            ("requests", "hits", "steps_reused", "reuse_induced_wrong", "wrong_vs_own_seed"),
            0))
        row["requests"] += 1
    for i, n in enumerate(hits):
        row = by_kind[kind_of(asked[n])]
        hit = records[n].approximate
        assert hit is not None
        row["hits"] += 1
        row["steps_reused"] += hit.step
        row["reuse_induced_wrong"] += int(induced[i])
        row["wrong_vs_own_seed"] += int(own[i])
    return by_kind


def made_wrong_rows(asked: list[TracePrompt], records: list[RequestRecord], hits: list[int],
                    induced: np.ndarray) -> list[list[object]]:
    """Each hit the reused steps made wrong: its kind, prompt, source's prompt, similarity
    and steps reused."""
    by_id = {r.spec.request_id: n for n, r in enumerate(records)}
    rows: list[list[object]] = []
    for i, n in enumerate(hits):
        hit = records[n].approximate
        if induced[i] and hit is not None:
            source = by_id.get(hit.source_request_id)
            rows.append([kind_of(asked[n]), asked[n].prompt,
                         "?" if source is None else asked[source].prompt,
                         f"{hit.similarity:.5f}", hit.step])
    return rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--scenes", type=int, default=40)
    parser.add_argument("--changes", type=int, default=2, help="changed prompts per scene")
    parser.add_argument("--min-similarity", type=float, default=0.9)
    parser.add_argument("--max-skip", type=float, default=DEFAULT_MAX_SKIP)
    parser.add_argument("--verify", type=int, default=5, help="rewritten requests recomputed")
    parser.add_argument("--arrival", choices=["begun", "served"], default="begun",
                        help="a wave arrives once the one before has begun denoising, or is "
                        "served")
    args = parser.parse_args()
    classifier = load_classifier()
    trace = [variants(i, rotating_changes(i, args.changes)) for i in range(args.scenes)]
    waves = [[prompts[w] for prompts in trace] for w in range(len(trace[0]))]
    modes = {"exact": Reuse(),
             "approximate": Reuse(ReuseMode.APPROXIMATE, args.min_similarity, args.max_skip)}
    runs: dict[str, Run] = {}
    with model_stack(model={"preset": "shapes"}) as settings:
        m = request_defaults(settings.model, settings.model_dir)
        records, cache = Records(open_redis(settings)), open_cache(settings)
        with workers(settings, settings.data_dir / "logs"):
            for mode, reuse in modes.items():
                runs[mode] = run_trace(records, cache, waves, args.arrival,
                                       functools.partial(trace_spec, m, f"trace-{mode}", reuse))
            _, approx_records, approx_frames, asked = runs["approximate"]
            hits = [n for n, r in enumerate(approx_records) if r.approximate is not None]
            # Each hit's prompt from its rewrite's seed, exactly; and a sample of the rewrites
            # themselves from scratch.
            _, at_seed = serve(records, cache, [
                exact_spec("trace-seed", asked[n].prompt, approx_records[n].spec)
                for n in hits])
            sample = [approx_records[n] for n in hits[:args.verify]]
            again = [exact_spec("trace-verify", "", r.spec, r.spec.schedule) for r in sample]
            _, recomputed = serve(records, cache, again)
        cache.close()
    # Each output of ``serve`` is one (1, H, W, 3) array; a run's are concatenated.
    identical = all(np.array_equal(approx_frames[n], f[0])
                    for n, f in zip(hits[:args.verify], recomputed, strict=True))
    wanted = [asked[n].scene for n in hits]
    induced = reuse_induced(classifier, approx_frames[hits], np.concatenate(at_seed), wanted)
    own = reuse_induced(classifier, approx_frames[hits], runs["exact"][2][hits], wanted)
    by_kind = per_kind(asked, approx_records, hits, induced, own)
    made_wrong = made_wrong_rows(asked, approx_records, hits, induced)
    if made_wrong:
        print_table("Hits the reused steps made wrong",
                    ["kind", "prompt", "source's prompt", "similarity", "steps reused"],
                    made_wrong)
    rows, acc, forwards, seconds, stages = [], {}, {}, {}, {}
    for mode, (elapsed, done, outputs, prompts) in runs.items():
        acc[mode] = float(correct(classifier, outputs, [p.scene for p in prompts]).mean())
        forwards[mode] = sum(r.counter("forwards") for r in done)
        seconds[mode] = elapsed
        # Where a request's time goes: the encode stage holds the search and its checks.
        stages[mode] = {stage.value: round(float(np.mean([r.stage_seconds().get(stage, 0.0)
                                                           for r in done])), 4)
                        for stage in Stage}
        reused = [r for r in done if r.approximate is not None]
        rows.append([mode, len(done), forwards[mode], len(done) / elapsed, acc[mode],
                     len(reused) / len(done), sum(r.approximate.step for r in reused
                                                  if r.approximate is not None),
                     *stages[mode].values()])
    print_table("Per kind of prompt (approximate mode)",
                ["kind", "requests", "hits", "steps reused", "reuse-induced wrong",
                 "wrong vs own seed"],
                [[kind, *row.values()] for kind, row in sorted(by_kind.items())])
    report(f"{len(approx_records)} requests ({args.scenes} scenes x {len(waves)} phrasings, "
           f"each its own seed) on the shapes model, per reuse mode (min_similarity "
           f"{args.min_similarity}, max_skip {args.max_skip})",
           ["mode", "requests", "forwards", "requests/s", "accuracy", "hit rate",
            "steps reused", *(f"{stage.value} s/request" for stage in Stage)], rows,
           {"bench": "reuse", "requests": len(approx_records),
            "forwards_saved": round(1 - forwards["approximate"] / forwards["exact"], 4),
            "throughput_ratio": round(seconds["exact"] / seconds["approximate"], 3),
            "acc_exact": round(acc["exact"], 4), "acc_approximate": round(acc["approximate"], 4),
            "acc_delta": round(acc["approximate"] - acc["exact"], 4),
            "hit_rate": round(len(hits) / len(approx_records), 4),
            "reuse_induced_wrong": int(induced.sum()),
            "wrong_vs_own_seed": int(own.sum()),
            "by_kind": {kind: {"hits": row["hits"],
                               "reuse_induced_wrong": row["reuse_induced_wrong"]}
                        for kind, row in sorted(by_kind.items())},
            "identical_rewrites": identical and bool(sample),
            "stage_s_per_request": stages})


if __name__ == "__main__":
    main()
