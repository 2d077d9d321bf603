"""One request's trajectory in the engine: where it stands, and how a step of it is planned
and finished around the forwards the engine runs for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cachesvc.ledger import Ledger
from keys import ChainLink, GenerationSpec, LoraUse, StoreKey
from workers.engine.checkpoint import Checkpoint
from workers.engine.guidance import Guidance, StepPlan
from workers.engine.row_caches import RunStepCache
from workers.engine.scheduler import RunView
from workers.engine.timing import seconds_since
from workers.families.base import Inpainting
from workers.families.scheduler_state import SchedulerFields
from workers.queue.messages import RefName, Role
from workers.queue.record_write import RecordWrite
from workers.queue.runtime import JobContext
from workers.queue.schema import Field
from workers.queue.streams import Delivery

# Each condition the job names: its store key (which keys the chain) and its tensor.
Embeddings = dict[RefName, tuple[StoreKey, torch.Tensor]]
# The adapters a run's forwards need, with the tenant they are loaded for; () for none.
AdapterSet = tuple[str, tuple[LoraUse, ...]] | tuple[()]


@dataclass
class DenoiseRun:
    """A denoise job in hand: its context, its trajectory state and what the steps need."""

    ctx: JobContext
    delivery: Delivery
    spec: GenerationSpec
    embeds: Embeddings
    links: list[ChainLink]
    scheduler: Any
    rng: torch.Generator
    latents: torch.Tensor
    step: int
    compute_s: float
    guidance: Guidance
    saves: frozenset[int]
    segments: list[int]
    adapters: AdapterSet
    step_cache: RunStepCache | None = None  # its hook state, when the request has a policy
    # The image condition every forward takes (image-to-video), with its key.
    condition: tuple[StoreKey, torch.Tensor] | None = None
    # Inpainting: what each step keeps of the input image, once the scheduler has taken it.
    inpainting: Inpainting | None = None
    has_credit: bool = False
    waited_for_credit: bool = False
    joined_at: float = field(default_factory=time.monotonic)
    first_step_at: float | None = None

    @property
    def queued_at(self) -> float:
        """When the job was added to its stream (wall clock, from the entry id)."""
        return int(self.delivery.entry_id.partition("-")[0]) / 1000

    @property
    def ledger(self) -> Ledger | None:
        """The attempt's ledger of lookups, which its guidance counts the CFG tier's in."""
        return self.guidance.ledger

    @property
    def weight(self) -> float:
        """The share of its rows its last step computed (``scheduler``)."""
        return 1.0 if self.step_cache is None else self.step_cache.computed_share

    @property
    def view(self) -> RunView:
        """What the scheduler reads of this run."""
        return RunView(frozenset(lora.hash for lora in self.spec.loras), self.ctx.preemptible,
                       self.weight)

    @property
    def finished(self) -> bool:
        return self.step >= self.spec.num_inference_steps

    @property
    def wants_stop(self) -> bool:
        """Cancelled, fenced off, or asked to make way: it leaves at the next boundary."""
        return self.ctx.should_stop or self.ctx.preempt is not None

    def plan(self) -> StepPlan:
        """The rows of the next step (after the CFG cache is asked)."""
        spec, i = self.spec, self.step
        segment = spec.schedule[self.segments[i]]
        cond = self.embeds[RefName(Role.PROMPT, self.segments[i])][1]
        negative = (self.embeds[RefName(Role.NEGATIVE, self.segments[i])]
                    if spec.segment_uses_cfg(segment) else None)
        plan = self.guidance.plan(i, self.latents, self.scheduler.timesteps[i], cond, negative,
                                  spec.guidance_of(segment), self.condition)
        if self.step_cache is not None:
            plan.rows = self.step_cache.attach(plan.rows)
        return plan

    def advance(self, plan: StepPlan, outputs: list[torch.Tensor], seconds: list[float]) -> None:
        """Finish the step ``plan`` began with its rows' outputs; report it."""
        start = time.perf_counter()
        if self.step_cache is not None:
            self.step_cache.commit(plan.rows)
        prediction = self.guidance.finish(plan, outputs, seconds)
        t = self.scheduler.timesteps[self.step]
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]
        if self.inpainting is not None:
            self.latents = self.inpainting.keep(self.latents, self.scheduler, self.step)
        self.compute_s += sum(seconds) + seconds_since(start, self.latents.device)
        self.step += 1
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        self.ctx.progress(RecordWrite({Field.STEP: self.step}))

    def stopped_mid_step(self) -> None:
        """The step was abandoned: nothing of it was applied, and the checkpoint is of the
        last whole step."""
        self.ctx.progress(RecordWrite({Field.STOPPED_MID_STEP: self.step}))

    def checkpoint(self, fields: SchedulerFields) -> Checkpoint:
        """Where the run stands; ``fields``: what its family's scheduler keeps between steps."""
        return Checkpoint.capture(self.step, self.latents, fields.capture(self.scheduler),
                                  self.rng,
                                  self.guidance.residual, self.compute_s,
                                  {} if self.step_cache is None else self.step_cache.state)
