"""What one transformer forward takes, and the call that runs it under its rows' choices.

The executor builds these from its rows; a denoise group's other ranks receive the same inputs
(``workers/parallel``) and make the same call, on the whole sequence split or on their part of
the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from keys import GenerationSpec
from workers.engine.exact_rows import rows_apart
from workers.engine.forward_rows import Forward, RowAdapters, running
from workers.families.base import Denoiser


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """A forward's rows, concatenated: their latents, timesteps and texts (padded where the
    family pads them: ``mask`` says which tokens are text), and their image conditions."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    embeds: torch.Tensor
    spec: GenerationSpec  # the first row's: rows of one forward share its geometry
    mask: torch.Tensor | None = None
    condition: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.latents.shape[0])

    def part(self, rows: slice) -> ForwardInputs:
        """These inputs' ``rows`` alone."""
        return ForwardInputs(self.latents[rows], self.timesteps[rows], self.embeds[rows],
                             self.spec, None if self.mask is None else self.mask[rows],
                             None if self.condition is None else self.condition[rows])


# Runs some of a forward's rows on this rank: their inputs, and which of the forward's rows
# they are (for their step caches and adapters).
Local = Callable[[ForwardInputs, slice], torch.Tensor]


class Ranks(Protocol):
    """The other ranks of a denoise group, which run each forward with this one
    (``workers/parallel``): ``run`` gives the forward's whole output, having had this rank
    compute its part with ``local``; ``refusal`` says why a request cannot run on them (None
    if it can), before any of its forwards."""

    def run(self, inputs: ForwardInputs, local: Local) -> torch.Tensor: ...

    def refusal(self, spec: GenerationSpec, tokens: int) -> str | None: ...


def predict(model: Denoiser, inputs: ForwardInputs,
            caches: Sequence[Any | None] | None = None,
            adapters: Sequence[RowAdapters] | None = None) -> torch.Tensor:
    """The family's prediction for ``inputs``, each row with its step cache and adapters
    (none, if not given), and the products over padded texts computed as each row alone."""
    n = inputs.rows
    with rows_apart(inputs.mask) as text, running(Forward(
            [None] * n if caches is None else caches,
            [()] * n if adapters is None else adapters, text)):
        return model.predict(inputs.latents, inputs.timesteps, inputs.embeds, inputs.spec,
                             inputs.mask, inputs.condition)
