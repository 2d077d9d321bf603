"""The engine's own check that its batched rows are exact on the machine it runs on.

Which matrix sizes round alike is a property of the CPU or GPU and its kernels, not of the code:
batched rows proven exact on one machine differed on another. So the first batched forward of
each geometry and batch size is also run row by row (or in batches of sizes already proven so,
which is cheaper and proves the same), and the rows compared bit for bit. A batch size whose
rows differ is never formed again for that geometry by this worker (kernels are picked per
size: a GPU library may round a batch of 8 unlike its rows and a batch of 4 alike); the
row-by-row outputs are the ones used, so no step ever takes a batched result that was not
proven equal to the row alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

from workers.engine.exact_rows import same_bits

log = logging.getLogger(__name__)

# What makes two forwards comparable for the proof: the latent shape, dtype and request
# geometry of their rows (texts of other lengths share them, padded).
Geometry = Hashable


class RowProof:
    """The geometries and batch sizes proven on this worker, and those refused."""

    def __init__(self) -> None:
        self._proven: set[tuple[Geometry, int]] = set()
        self.refused: set[tuple[Geometry, int]] = set()

    @property
    def verdicts(self) -> int:
        """How many proofs this worker has run: a forward that ran one took the rows alone
        as well, so its time says nothing of the forward's own."""
        return len(self._proven) + len(self.refused)

    def proven(self, geometry: Geometry, size: int) -> bool:
        return (geometry, size) in self._proven

    def largest_proven(self, geometry: Geometry, below: int) -> int:
        """The largest batch size under ``below`` proven for ``geometry`` (1: none)."""
        return max((size for g, size in self._proven if g == geometry and size < below),
                   default=1)

    def trusted(self, geometry: Geometry, size: int) -> bool:
        """Whether ``size`` rows of ``geometry`` may share a forward."""
        return (geometry, size) not in self.refused

    def usable(self, geometry: Geometry, most: int) -> int:
        """The largest batch size up to ``most`` not refused for ``geometry`` (1: rows
        alone): forwards are cut to it, so one refused size does not end batching."""
        return next((size for size in range(most, 1, -1) if self.trusted(geometry, size)), 1)

    def settle(self, geometry: Geometry, batched: torch.Tensor,
               alone: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output to use for a batched forward of ``geometry``: the batched one once its
        batch size is proven; the first time, ``alone`` (the same rows as forwards already
        proven compute them: each alone, or in batches of proven sizes) is computed as well
        and decides. Equal to what is equal to each row alone is equal to each row alone."""
        size = batched.shape[0]
        if (geometry, size) in self._proven:
            return batched
        separate = alone()
        if all(same_bits(batched[i:i + 1], separate[i:i + 1]) for i in range(size)):
            self._proven.add((geometry, size))
            return batched
        self.refused.add((geometry, size))
        log.warning("rows of %s differ between a batch of %d and alone on this device: no "
                    "batch of %d is formed from now on", geometry, size, size)
        return separate
