"""The cache under memory pressure: what eviction by value saves against Mooncake's own LRU and
against an offline optimum with the same memory.

A trace of 300 requests from 2 tenants on the random model sized for timing (preset
``default``): prompts drawn Zipf over a pool, negative prompts from three shared ones, 20% seeded
repeats of an earlier request (same prompt, negative prompt and seed), 20% prompt schedules
that keep an earlier request's prompt and seed for the first half of the steps and change the
prompt for the second, the rest fresh seeds. Requests arrive in waves; a repeat or an edit
refers to a request of an earlier wave.

The trace runs three times, each on a stack of its own: once on a roomy store, which measures
the bytes the trace writes, the compute each entry cost and the outputs every run must match
bit for bit; then on a storage node sized to a fifth of those bytes (16 MiB at least,
Mooncake's minimum), once with the policy (write admission and the value sweeper, every
``cache.evict_interval_s``, as ``diffcache up`` runs it) and once with plain Mooncake LRU
(every write admitted, no sweeper). Outputs live in the store alone (``cache.durable_outputs``
off): on disk too, an evicted output would come back at no cost to either. Each wave's outputs
are read as soon as it is done; one gone by then counts as lost.

Every run keeps a lookup log (``cache.lookup_log_dir``). The seconds saved are the costs of
the hits in it, each entry valued at what the roomy run measured, so that timing noise does
not tell the runs apart.

The offline figure, ``saved_s_offline``, bounds what any policy with the node's memory could
save, as the lesser of two bounds:

- the LP bound of ``bench.offline_optimum`` on the run's own log at the node's memory
  (``saved_s_lp``), a bound for that run's sequence of lookups. That sequence holds the
  lookups the run's own misses led to (an output missed, then its chain's checkpoints, then
  CFG features), and the bound counts a saving on each, where a cache that kept the output
  would have saved the request once;
- what the roomy run saved (``saved_s_roomy``). A smaller store holds a subset of what the
  roomy one holds at the same point of the trace, so no request saves more in it (up to the
  order in which requests of one wave finish).

From below, ``saved_s_belady`` is what Belady's MIN weighted by cost per byte saves on the
roomy run's log at the node's memory: the lookups of a policy that knows the future, and so
never misses an entry that is read again, keeping only what fits the memory. The optimum lies
between it and ``saved_s_offline``; where the two meet, the optimum is known.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import WAIT_ALL_S, bench_parser, model_stack, report, workers
from bench.offline_optimum import Known, LogSavings, belady_s, costs_and_sizes, savings
from bench.workload import NEGATIVE_PROMPTS, prompt_pool
from cachesvc.connect import open_cache
from cachesvc.counters import CacheCounters
from cachesvc.errors import CacheError
from cachesvc.lookup_log import LoggedAccess, read_log
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints
from cachesvc.redis_client import REDIS_ERRORS, open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.value_sweep import SweepReport, ValueSweeper, store_capacity
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import GenerationSpec, OutputFormat, PromptSegment, StoreKey
from workers.queue.records import Records
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy

MIN_SEGMENT_MIB = 16  # Mooncake refuses a smaller storage segment
ROOMY_SEGMENT_MIB = 2048


@dataclass(frozen=True, slots=True)
class Asked:
    """One request of the trace; ``edit`` is the prompt of a schedule's second half."""

    tenant: str
    prompt: str
    negative_prompt: str
    seed: int
    edit: str | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """One pass of the trace: its log's savings, outputs in trace order (None where a request
    was lost), the seconds it took and the value sweeps it saw."""

    savings: LogSavings
    outputs: list[np.ndarray | None]
    seconds: float
    sweeps: list[SweepReport]

    @property
    def lost(self) -> int:
        return sum(out is None for out in self.outputs)

    def offline_s(self, roomy: Run) -> float:
        """The most any policy with this run's memory could have saved (module docstring)."""
        return min(self.savings.bound_s, roomy.savings.saved_s)

    def share(self, roomy: Run) -> float:
        """The seconds saved, as a share of ``offline_s``."""
        offline = self.offline_s(roomy)
        return self.savings.saved_s / offline if offline else 0.0


def trace(requests: int, tenants: int, repeats: float, edits: float, wave: int,
          seed: int) -> list[list[Asked]]:
    """The trace's waves. A repeat or an edit draws on a tenant's requests of earlier waves
    that were neither (an edit is not repeated or edited again)."""
    rng = random.Random(seed)
    pool = prompt_pool(60, seed)
    weights = [1.0 / rank ** 1.1 for rank in range(1, len(pool) + 1)]
    earlier: dict[str, list[Asked]] = {f"tenant{t}": [] for t in range(tenants)}
    waves: list[list[Asked]] = []
    for start in range(0, requests, wave):
        current = []
        for _ in range(min(wave, requests - start)):
            tenant = rng.choice(sorted(earlier))
            draw, before = rng.random(), earlier[tenant]
            if before and draw < repeats:
                current.append(rng.choice(before))
            elif before and draw < repeats + edits:
                source = rng.choice(before)
                current.append(Asked(tenant, source.prompt, source.negative_prompt,
                                     source.seed, rng.choices(pool, weights)[0]))
            else:
                current.append(Asked(tenant, rng.choices(pool, weights)[0],
                                     rng.choice(NEGATIVE_PROMPTS), rng.randrange(2**31)))
        for tenant in earlier:
            earlier[tenant] += [a for a in current if a.tenant == tenant and a.edit is None]
        waves.append(current)
    return waves


def spec_of(asked: Asked, settings: Settings, steps: int) -> GenerationSpec:
    m = request_defaults(settings.model, settings.model_dir)
    schedule = None
    if asked.edit is not None:
        schedule = (PromptSegment(asked.prompt, asked.negative_prompt, steps // 2),
                    PromptSegment(asked.edit, asked.negative_prompt, steps))
    return GenerationSpec.create(
        request_id=new_request_id(), tenant=asked.tenant,
        prompt="" if schedule else asked.prompt, negative_prompt=asked.negative_prompt,
        schedule=schedule,
        width=m.width, height=m.height, num_frames=m.num_frames, num_inference_steps=steps,
        guidance_scale=m.guidance_scale, seed=asked.seed, output_format=OutputFormat.NPY)


def wait_ended(records: Records, specs: Sequence[GenerationSpec]) -> list[RequestRecord | None]:
    """Once every one of ``specs`` has ended, however: their records, in order."""
    keys = [(s.tenant, s.request_id) for s in specs]

    def ended() -> bool:
        return all(s is not None and s.terminal for s in records.states(keys))

    wait_until(ended, timeout_s=WAIT_ALL_S, interval_s=0.05, what=f"{len(specs)} requests")
    return [records.get(tenant, request_id) for tenant, request_id in keys]


@contextmanager
def value_sweeps(settings: Settings, on: bool) -> Iterator[list[SweepReport]]:
    """The value sweeper on a thread, as ``diffcache up``'s head runs it (when ``on``); the
    reports of its sweeps that evicted or found anything."""
    reports: list[SweepReport] = []
    if not on:
        yield reports
        return
    client = open_redis(settings)
    store = MooncakeStore.connect(StoreEndpoints.configured(settings.store), settings.store)
    counters = CacheCounters(client, settings.cache.stats_flush_s)
    sweeper = ValueSweeper(client, store, counters, store_capacity(settings), settings.cache,
                           Records(client).ended)
    stop = threading.Event()

    def sweep() -> None:
        while not stop.wait(settings.cache.evict_interval_s):
            try:
                done = sweeper.sweep()
            except (CacheError, *REDIS_ERRORS) as exc:
                print(f"value sweep failed, retrying: {exc}", flush=True)
                continue
            if done.evicted or done.found_gone or done.busy or done.needed:
                reports.append(done)

    thread = threading.Thread(target=sweep, name="value-sweeper", daemon=True)
    thread.start()
    try:
        yield reports
    finally:
        stop.set()
        thread.join()
        counters.close()
        store.close()


def run(waves: list[list[Asked]], segment_mib: int, policy: bool, steps: int,
        logs: Path | None, costs: Known | None = None) -> tuple[Run, list[LoggedAccess]]:
    """The trace through a stack of its own with a node of ``segment_mib``; the run, and its
    lookup log. Each wave's outputs are read as soon as it is done. The
    lookup log is kept under ``logs`` where given."""
    # Outputs live in the store alone, as on workers without a shared disk: with durable
    # outputs, an evicted one would come back from its file at no cost to any policy.
    cache: dict[str, object] = {"durable_outputs": False}
    if not policy:
        cache["admission_min_hit_rate"] = 0.0  # every write admitted
    name = f"{'policy' if policy else 'lru'}-{segment_mib}mib"
    with tempfile.TemporaryDirectory(prefix="diffcache-lookups-") as scratch:
        log_dir = logs / name if logs is not None else Path(scratch)
        cache["lookup_log_dir"] = str(log_dir)
        with model_stack(segment_mib, cache=cache) as settings:
            client = open_redis(settings)
            records, reader = Records(client), open_cache(settings, client)
            outputs: list[np.ndarray | None] = []
            with workers(settings, settings.data_dir / "logs" / name), \
                    value_sweeps(settings, policy) as sweeps:
                start = time.perf_counter()
                for n, wave in enumerate(waves):
                    specs = [spec_of(a, settings, steps) for a in wave]
                    for spec in specs:
                        submit(client, spec)
                    outputs += [output(reader, r) for r in wait_ended(records, specs)]
                    print(f"{name}: wave {n + 1}/{len(waves)}", flush=True)
                seconds = time.perf_counter() - start
            reader.close()
            log = read_log(log_dir)
    return Run(savings(log, segment_mib << 20, costs), outputs, seconds, sweeps), log


def output(reader: TensorCache, record: RequestRecord | None) -> np.ndarray | None:
    """A done request's frames; None for a lost request, or an output gone before its read."""
    if record is None or record.state is not State.DONE or record.output_key is None:
        return None
    data = reader.get(StoreKey.parse(record.output_key), lookup=False)
    return None if data is None else decode_npy(data.numpy().tobytes())


def identical(run: Run, roomy: Run) -> bool:
    return all(a is not None and b is not None and np.array_equal(a, b)
               for a, b in zip(run.outputs, roomy.outputs, strict=True))


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--repeats", type=float, default=0.2)
    parser.add_argument("--edits", type=float, default=0.2)
    parser.add_argument("--wave", type=int, default=10, help="requests that arrive together")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.2,
                        help="of the bytes the trace writes, the storage node's size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep each run's lookup log in a folder of its own here")
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    waves = trace(args.requests, args.tenants, args.repeats, args.edits, args.wave, args.seed)
    roomy, roomy_log = run(waves, ROOMY_SEGMENT_MIB, True, args.steps, args.logs)
    costs = costs_and_sizes(roomy_log)
    segment = max(MIN_SEGMENT_MIB, round(roomy.savings.written_bytes * args.fraction) >> 20)
    runs = {"policy": run(waves, segment, True, args.steps, args.logs, costs)[0],
            "lru": run(waves, segment, False, args.steps, args.logs, costs)[0]}
    report_runs(args, segment, roomy, runs, belady_s(roomy_log, costs, segment << 20))


def report_runs(args: argparse.Namespace, segment: int, roomy: Run, runs: dict[str, Run],
                belady: float) -> None:
    kinds = sorted({k for r in (roomy, *runs.values()) for k in r.savings.saved_by_kind})
    rows = []
    for name, r in {f"roomy ({ROOMY_SEGMENT_MIB} MiB)": roomy,
                    **{f"{n} ({segment} MiB)": r for n, r in runs.items()}}.items():
        measured = r is not roomy  # the roomy run is its own reference
        rows.append([name, r.savings.lookups, r.savings.hits, r.savings.saved_s,
                     *(r.savings.saved_by_kind.get(k, 0.0) for k in kinds),
                     r.savings.bound_s, r.offline_s(roomy) if measured else "",
                     r.share(roomy) if measured else "", r.lost,
                     sum(s.evicted for s in r.sweeps), r.seconds])
        if measured and r.share(roomy) > 1:
            print(f"{name} saved more than the roomy run: requests of a wave finished in "
                  "another order, so the bound is approximate", flush=True)
    policy, lru = runs["policy"], runs["lru"]
    report(f"{args.requests} requests, {args.tenants} tenants; the trace writes "
           f"{roomy.savings.written_bytes / (1 << 20):.0f} MiB, the node holds {segment} MiB; "
           f"Belady's weighted MIN there saves {belady:.1f} s",
           ["run", "lookups", "hits", "saved s", *(f"by {k.value}" for k in kinds),
            "LP bound s", "offline s", "of offline", "lost", "evicted by value", "seconds"],
           rows,
           {"bench": "pressure", "requests": args.requests, "segment_mib": segment,
            "saved_s_policy": round(policy.savings.saved_s, 3),
            "saved_s_lru": round(lru.savings.saved_s, 3),
            "saved_s_offline": round(policy.offline_s(roomy), 3),
            "saved_s_offline_lru": round(lru.offline_s(roomy), 3),
            "ratio_to_offline": round(policy.share(roomy), 4),
            "lru_ratio_to_offline": round(lru.share(roomy), 4),
            "saved_s_lp": round(policy.savings.bound_s, 3),
            "saved_s_roomy": round(roomy.savings.saved_s, 3),
            "saved_s_belady": round(belady, 3),
            "lost_requests": policy.lost + lru.lost,
            "identical": identical(policy, roomy) and identical(lru, roomy)})

if __name__ == "__main__":
    main()
