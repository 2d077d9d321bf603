"""A denoise worker's group of ranks. Rank 0 is the worker: it starts the other ranks, runs
the engine and the queue loop, and hands each forward's inputs to the others (``Wire``); every
rank runs every forward, its sequence split by diffusers' context parallelism, or a part of its
rows. A rank that dies takes the group down, and its jobs are taken over like any dead
worker's."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch
import torch.distributed as dist

from config.settings import Settings
from keys import GenerationSpec
from supervision.processes import free_port
from supervision.supervisor import EXIT_CANNOT_FIT
from workers.engine.forward_inputs import ForwardInputs, Local, predict
from workers.families.base import Denoiser, Placement
from workers.parallel.layout import ParallelLayout
from workers.parallel.wire import Wire

log = logging.getLogger(__name__)

# The exit of a rank 0 whose group lost a rank: the supervisor restarts the whole group.
EXIT_RANK_LOST = 70


@dataclass(frozen=True, slots=True)
class Rank:
    """One process of a group: its rank, the group's size, where the group meets, and the
    device it computes on."""

    rank: int
    ranks: int
    port: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def wire(self) -> Wire:
        return Wire(self.device)

    def join(self, timeout_s: float) -> None:
        """Meet the group's other ranks (this blocks until all have come)."""
        dist.init_process_group(self.backend, init_method=f"tcp://127.0.0.1:{self.port}",
                                rank=self.rank, world_size=self.ranks,
                                timeout=timedelta(seconds=timeout_s))


def rank_placement(placement: Placement, rank: int) -> Placement:
    """Where rank ``rank`` computes: the next GPU on from the worker's own for each rank (one
    device per rank), or the same CPU."""
    device = placement.device
    if device.type != "cuda":
        return placement
    return replace(placement, device=torch.device("cuda", (device.index or 0) + rank))


class SplitForwards:
    """How rank 0 runs each forward with the group's other ranks (the executor's ``Ranks``):
    its sequence split over every rank, or its rows shared out, each rank computing its part
    whole."""

    def __init__(self, wire: Wire, layout: ParallelLayout, dtype: torch.dtype) -> None:
        self.wire = wire
        self.layout = layout
        self.dtype = dtype  # of the transformer's output, which has its latents' shape

    def run(self, inputs: ForwardInputs, local: Local) -> torch.Tensor:
        if self.layout.rows == 1:  # the sequence is split: every rank runs all of it
            self.wire.send(inputs)
            try:
                return local(inputs, slice(None))
            except BaseException:
                # The other ranks wait inside this forward's collectives for a part this
                # rank will never give: no later forward can meet them. End the group; its
                # jobs are taken over from their checkpoints.
                log.exception("denoise group: rank 0 failed inside a split forward")
                end_group(EXIT_RANK_LOST)
        parts = self.layout.row_parts(inputs.rows)
        if inputs.rows == 1:
            return local(inputs, parts[0])  # nothing to share: the others stay idle
        self.wire.send(inputs)
        theirs: list[torch.Tensor] = []
        try:
            mine = local(inputs.part(parts[0]), parts[0]).to(self.dtype)
        finally:
            # Taken even if this rank's part raised: a rank left holding its part would
            # wait for rank 0 through every forward after.
            theirs = [self.wire.take(inputs.latents, self.dtype, part, rank)
                      for rank, part in enumerate(parts) if rank and part.stop > part.start]
        return torch.cat([mine, *theirs])

    def refusal(self, spec: GenerationSpec, tokens: int) -> str | None:
        """Why ``spec`` cannot run on this group: what only rank 0 would apply (step caches,
        adapters), or a sequence its split cannot cut evenly."""
        if spec.step_cache.on or spec.loras:
            return (f"a denoise worker split over {self.layout.ranks} ranks "
                    "(workers.denoise_parallel) runs no step cache and no adapter yet")
        if not self.layout.cuts(tokens):
            return (f"its {tokens} image tokens do not split into "
                    f"{self.layout.sequence_ranks} equal parts, as this deployment's denoise "
                    "workers split them (workers.denoise_parallel); another size, or "
                    "ulysses_anything, serves it")
        return None


def end_group(code: int) -> NoReturn:
    """End this process at once, and with it its group: the supervisor starts it again."""
    logging.shutdown()
    os._exit(code)


class DenoiseGroup:
    """Rank 0's side: the other ranks it started, and how forwards run with them."""

    def __init__(self, me: Rank, layout: ParallelLayout, others: Sequence[BaseProcess],
                 dtype: torch.dtype) -> None:
        self.me = me
        self.forwards = SplitForwards(me.wire, layout, dtype)
        self.others = others
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="denoise-group-watch", daemon=True).start()

    def stop(self) -> None:
        """The other ranks stop after the forward at hand."""
        self._stopping.set()
        self.me.wire.send(None)
        for process in self.others:
            process.join(timeout=30)

    def abandon(self) -> None:
        """End the other ranks now (this one failed before the group could run)."""
        self._stopping.set()
        for process in self.others:
            process.kill()

    def _watch(self) -> None:
        """A rank that dies leaves this one waiting inside a collective: end the worker, so
        its leases lapse and the supervisor starts the group again."""
        gone = wait([p.sentinel for p in self.others])
        if self._stopping.is_set():
            return
        dead = next(p for p in self.others if p.sentinel in gone)
        log.error("denoise group: rank %s exited with %s; the group stops", dead.name,
                  dead.exitcode)
        for process in self.others:
            process.kill()
        # A rank that cannot fit its model tells the supervisor so, as a lone worker would.
        end_group(EXIT_CANNOT_FIT if dead.exitcode == EXIT_CANNOT_FIT else EXIT_RANK_LOST)


def start_group(settings: Settings, placement: Placement,
                load: Callable[[Placement], Denoiser], check: Callable[[Denoiser], None]
                ) -> tuple[Denoiser, DenoiseGroup]:
    """Start the other ranks of this worker's group, meet them, and load the denoiser split
    as ``workers.denoise_parallel`` says, once ``check`` (which raises) has taken it; rank
    0's denoiser and its group."""
    layout = ParallelLayout.of(settings.workers.denoise_parallel)
    port = free_port("127.0.0.1")
    context = multiprocessing.get_context("spawn")  # no forked copy of this process's threads
    others = [context.Process(target=follow, name=f"rank-{rank}", daemon=True,
                              args=(settings.model_dump_json(), rank, port, placement))
              for rank in range(1, layout.ranks)]
    for process in others:
        process.start()
    me = Rank(0, layout.ranks, port, placement.device)
    # Watched from the start: a rank that fails before it joins would leave this one
    # waiting to meet it.
    group = DenoiseGroup(me, layout, others, placement.dit_dtype)
    try:
        me.join(settings.workers.denoise_parallel.collective_timeout_s)
        denoiser = load(placement)
        check(denoiser)
        if layout.sequence_ranks > 1:
            denoiser.pads_text = False  # as on the other ranks (``follow``)
        layout.enable(denoiser.transformer)
    except BaseException:
        group.abandon()  # they would wait for this rank in a collective
        raise
    log.info("denoise group of %d ranks (%s) on %s", layout.ranks, layout.name or "rows",
             placement.device)
    return denoiser, group


def follow(settings_json: str, rank: int, port: int, placement: Placement) -> None:
    """A rank other than 0: meet the group, load the denoiser split alike, then run every
    forward rank 0 hands over until it says stop (or dies, which ends this one)."""
    from workers.families import resolve

    # Rank 0 decides when the group stops: a Ctrl-C in a terminal reaches every process of
    # the foreground group, and rank 0 first checkpoints its runs, which needs this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    # The settings as rank 0 read them (it uses only the model's and the workers').
    settings = Settings.model_validate_json(settings_json)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank-{rank} %(name)s %(levelname)s %(message)s")
    if settings.workers.denoise_threads:
        torch.set_num_threads(settings.workers.denoise_threads)
    here = rank_placement(placement, rank)
    if here.device.type == "cuda":
        torch.cuda.set_device(here.device)
    layout = ParallelLayout.of(settings.workers.denoise_parallel)
    me = Rank(rank, layout.ranks, port, here.device)
    me.join(settings.workers.denoise_parallel.collective_timeout_s)
    family = resolve(settings.model.family, settings.model_dir, settings.model.preset)
    try:
        denoiser = family.denoiser(settings.model_dir, here)
    except torch.OutOfMemoryError:
        log.exception("rank %d: out of device memory loading the model", rank)
        end_group(EXIT_CANNOT_FIT)
    if layout.sequence_ranks > 1:
        # Texts of different lengths do not share a forward here: padded texts are told
        # from image tokens by their length, and each rank holds a part of the image's.
        denoiser.pads_text = False
    layout.enable(denoiser.transformer)
    run_forwards(denoiser, me.wire, layout, rank, here.dit_dtype)


def _end_with_parent() -> None:
    """End this rank when rank 0 ends, however it ends (NCCL need not fail a collective
    whose peer died, and an idle rank is in none)."""
    parent = multiprocessing.parent_process()
    assert parent is not None  # started by rank 0

    def watch() -> None:
        wait([parent.sentinel])
        end_group(EXIT_RANK_LOST)

    threading.Thread(target=watch, name="rank-0-watch", daemon=True).start()


def run_forwards(denoiser: Denoiser, wire: Wire, layout: ParallelLayout, rank: int,
                 dtype: torch.dtype) -> None:
    """Every forward rank 0 hands over, until it says stop: the whole of it where the
    sequence is split, else this rank's part of its rows, whose output (in ``dtype``, the
    DiT's) goes back."""
    with torch.no_grad():
        while (inputs := wire.receive()) is not None:
            if layout.rows == 1:
                predict(denoiser, inputs)
                continue
            part = layout.row_parts(inputs.rows)[rank]
            if part.stop > part.start:
                wire.give(predict(denoiser, inputs.part(part)).to(dtype))
