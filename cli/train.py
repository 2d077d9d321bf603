"""``diffcache model train`` and ``train-classifier``: make the shipped shapes model and its
yardstick again, with progress, timed checkpoints and resume."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

MAX_STEPS = typer.Option(None, "--max-steps", min=1, help="stop after this many steps, with "
                         "a checkpoint; run the same command again to continue")
CHECKPOINT_MINUTES = typer.Option(3.0, "--checkpoint-minutes", min=0.0,
                                  help="write a checkpoint this often")
THREADS = typer.Option(2, "--threads", min=1, help="torch intra-op threads")
# Each plan's defaults live in its dataclass only (the shipped weights were made with them).
PLAN_DEFAULT = "default: the plan's (README)"


def _run(plan_class: type[Any], given: dict[str, Any], train_it: Callable[..., bool],
         out: str, work: str, max_steps: int | None, checkpoint_minutes: float,
         threads: int) -> None:
    """Make the plan from the options given (the plan's defaults for the rest), train it, and
    say how the run ended; a bad plan or checkpoint is one line and exit status 2."""
    import torch

    from training.checkpoint import CheckpointError, PlanError
    from training.phases import Budget

    torch.set_num_threads(threads)
    try:
        plan = plan_class(**{k: v for k, v in given.items() if v is not None})
        done = train_it(plan, Path(out), Path(work), Budget(checkpoint_minutes * 60, max_steps))
    except (PlanError, CheckpointError) as exc:
        errors.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if done:
        console.print(f"[green]wrote[/green] {out}")
    else:
        console.print(f"stopped at the step budget; checkpoint in {work}; run again to go on")


def train(
    out: str = typer.Option(..., "--out", help="the diffusers folder to write (to remake the "
                             "shipped model: workers/families/trained/shapes)"),
    work: str = typer.Option(..., "--work", help="checkpoints and the untrained start; "
                              "reuse it to resume"),
    seed: int | None = typer.Option(None, "--seed", help=PLAN_DEFAULT),
    architecture: str | None = typer.Option(None, "--architecture", help="shapes (the "
                                            "shipped one) or test (tiny); " + PLAN_DEFAULT),
    vae_steps: int | None = typer.Option(None, "--vae-steps", min=0, help=PLAN_DEFAULT),
    vae_batch: int | None = typer.Option(None, "--vae-batch", min=1, help=PLAN_DEFAULT),
    dit_steps: int | None = typer.Option(None, "--dit-steps", min=0, help=PLAN_DEFAULT),
    dit_batch: int | None = typer.Option(None, "--dit-batch", min=1, help=PLAN_DEFAULT),
    max_steps: int | None = MAX_STEPS,
    checkpoint_minutes: float = CHECKPOINT_MINUTES,
    threads: int = THREADS,
) -> None:
    """Train the shapes model (the shipped image family's classes) on synthetic scenes, on CPU."""
    from training.shapes_model import TrainPlan
    from training.shapes_model import train as train_shapes

    _run(TrainPlan, {"seed": seed, "architecture": architecture, "vae_steps": vae_steps,
                     "vae_batch": vae_batch, "dit_steps": dit_steps, "dit_batch": dit_batch},
         train_shapes, out, work, max_steps, checkpoint_minutes, threads)


def train_classifier(
    out: str = typer.Option(..., "--out", help="the safetensors file to write (to remake the "
                             "shipped one: training/trained/attribute_classifier.safetensors)"),
    work: str = typer.Option(..., "--work", help="checkpoints; reuse it to resume"),
    seed: int | None = typer.Option(None, "--seed", help=PLAN_DEFAULT),
    steps: int | None = typer.Option(None, "--steps", min=0, help=PLAN_DEFAULT),
    batch: int | None = typer.Option(None, "--batch", min=1, help=PLAN_DEFAULT),
    max_steps: int | None = MAX_STEPS,
    checkpoint_minutes: float = CHECKPOINT_MINUTES,
    threads: int = THREADS,
) -> None:
    """Train the attribute classifier that bench.quality reads outputs with."""
    from training.classifier import ClassifierPlan
    from training.classifier import train_classifier as train_it

    _run(ClassifierPlan, {"seed": seed, "steps": steps, "batch": batch}, train_it, out, work,
         max_steps, checkpoint_minutes, threads)
