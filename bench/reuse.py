"""Approximate reuse on a similarity-rich trace through the service, on the shipped shapes
model: 40 scenes, each asked five ways (``bench.reuse_trace``), every request with its own
seed, in five waves (the captions, then each other phrasing in turn, as similar prompts keep
arriving). A wave arrives once the one before has left the queue (its every request has begun
to denoise), so the service has work throughout, as under steady traffic; with ``--arrival
served`` it waits until the one before is done. The trace runs twice in one stack, once per
mode, each in a tenant of its own.

Per mode: denoise forwards, throughput, and the classifier's accuracy on the attributes each
prompt asks for; for the approximate run, the hit rate, the steps reused, and the hits whose
output shows an attribute of the source's that the request did not ask for. A sample of the
rewritten requests is computed again from scratch (another tenant: no shared checkpoint) and
compared bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np

from bench.common import WAIT_ALL_S, collect, model_stack, report, serve, wait_all, workers
from bench.reuse_trace import TracePrompt, correct, variants
from cachesvc.connect import open_cache, open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from keys import DEFAULT_MAX_SKIP, GenerationSpec, OutputFormat, Reuse, ReuseMode
from training.classifier import load_classifier
from workers.queue.records import Records
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import RequestDefaults, request_defaults
from workers.queue.submit import new_request_id, submit

WAVES = 5
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenes", type=int, default=40)
    parser.add_argument("--min-similarity", type=float, default=0.9)
    parser.add_argument("--max-skip", type=float, default=DEFAULT_MAX_SKIP)
    parser.add_argument("--verify", type=int, default=5, help="rewritten requests recomputed")
    parser.add_argument("--arrival", choices=["begun", "served"], default="begun",
                        help="a wave arrives once the one before has begun denoising, or is "
                        "served")
    args = parser.parse_args()
    classifier = load_classifier()
    trace = [variants(i) for i in range(args.scenes)]
    waves = [[prompts[w] for prompts in trace] for w in range(WAVES)]
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
            rewritten = [r for r in runs["approximate"][1] if r.approximate is not None]
            sample = rewritten[:args.verify]
            again = [GenerationSpec.create(
                request_id=new_request_id(), tenant="trace-verify", prompt="",
                width=r.spec.width, height=r.spec.height, num_frames=1,
                num_inference_steps=r.spec.num_inference_steps,
                guidance_scale=r.spec.guidance_scale, seed=r.spec.seed,
                output_format=OutputFormat.NPY, schedule=r.spec.schedule) for r in sample]
            _, recomputed = serve(records, cache, again)
        cache.close()
    by_id = {r.spec.request_id: p for r, p in zip(runs["approximate"][1],
                                                  runs["approximate"][3], strict=True)}
    approx_frames = dict(zip((r.spec.request_id for r in runs["approximate"][1]),
                             runs["approximate"][2], strict=True))
    # Each output of ``serve`` is one (1, H, W, 3) array; a run's are concatenated.
    identical = all(np.array_equal(approx_frames[r.spec.request_id], f[0])
                    for r, f in zip(sample, recomputed, strict=True))
    wrong = 0
    for record in rewritten:
        hit = record.approximate
        assert hit is not None
        source, target = by_id.get(hit.source_request_id), by_id[record.spec.request_id]
        if source is None:
            continue
        read = classifier.read(approx_frames[record.spec.request_id][None])
        got, theirs, mine = ({k: int(v[0]) for k, v in read.items()}, source.scene.labels(),
                             target.scene.labels())
        wrong += any(theirs[a] != mine[a] and got[a] == theirs[a] for a in got)
    rows, acc, forwards, seconds = [], {}, {}, {}
    for mode, (elapsed, done, outputs, asked) in runs.items():
        acc[mode] = float(correct(classifier, outputs, [p.scene for p in asked]).mean())
        forwards[mode] = sum(r.counter("forwards") for r in done)
        seconds[mode] = elapsed
        hits = [r for r in done if r.approximate is not None]
        rows.append([mode, len(done), forwards[mode], len(done) / elapsed, acc[mode],
                     len(hits) / len(done), sum(r.approximate.step for r in hits
                                                if r.approximate is not None)])
    hit_rate = len(rewritten) / len(runs["approximate"][1])
    report(f"{len(runs['exact'][1])} requests ({args.scenes} scenes x {WAVES} phrasings, each "
           f"its own seed) on the shapes model, per reuse mode (min_similarity "
           f"{args.min_similarity}, max_skip {args.max_skip})",
           ["mode", "requests", "forwards", "requests/s", "accuracy", "hit rate",
            "steps reused"], rows,
           {"bench": "reuse", "requests": len(runs["exact"][1]),
            "forwards_saved": round(1 - forwards["approximate"] / forwards["exact"], 4),
            "throughput_ratio": round(seconds["exact"] / seconds["approximate"], 3),
            "acc_exact": round(acc["exact"], 4), "acc_approximate": round(acc["approximate"], 4),
            "acc_delta": round(acc["approximate"] - acc["exact"], 4),
            "hit_rate": round(hit_rate, 4), "wrong_attribute_hits": wrong,
            "identical_rewrites": identical and bool(sample)})


if __name__ == "__main__":
    main()
