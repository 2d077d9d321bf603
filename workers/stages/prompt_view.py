"""The vectors approximate reuse compares prompts by. The text encoder's mean is any model's;
the denoiser's first step is what a prompt does to a trajectory, which is what a reused prefix
must share: two prompts whose first predictions agree start their images alike."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional

from encoders.text import MeanPooled, PromptView, unit
from keys import GenerationSpec
from workers.engine.exact_rows import pad_texts
from workers.families.base import Denoiser

# The model card's ``reuse_vector`` values.
TEXT_MEAN = MeanPooled.name
FIRST_STEP = "denoiser-first-step"
PROMPT_EFFECT = "denoiser-prompt-effect"
VIEWS = (TEXT_MEAN, FIRST_STEP, PROMPT_EFFECT)

# A vector longer than this is brought down to this many floats: the index holds one vector
# per request and searches a bucket by scanning part of it, so a lookup's cost and a worker's
# memory grow with the vector (a million of 1,024 floats: a 5.7 ms p99 and 4 GB a copy).
MAX_FLOATS = 256
SKETCH_SEED = 0  # the hashing of ``PromptEffect``: fixed, so every worker's vectors compare


class ReuseViewError(ValueError):
    """The model card names a vector this server does not make."""


class FirstStep:
    """The denoiser's first prediction for the prompt, conditional only, from the noise of
    seed 0 at the request's first timestep: the same start for every request of a bucket (one
    shape, steps and scheduler), so what differs is what the prompt does. One forward at
    encode, against the many that a reused prefix saves. Longer than ``MAX_FLOATS``, it is
    averaged down in contiguous runs (which pools neighbouring latent positions: the
    ``PromptEffect`` view keeps them)."""

    name = FIRST_STEP

    def __init__(self, denoiser: Denoiser) -> None:
        self.denoiser = denoiser

    def vector(self, embedding: torch.Tensor, positions: int,
               spec: GenerationSpec) -> np.ndarray:
        flat = self.prediction(embedding, spec)
        if flat.numel() > MAX_FLOATS:
            flat = functional.adaptive_avg_pool1d(flat[None, None], MAX_FLOATS)[0, 0]
        return unit(flat)

    @torch.no_grad()
    def prediction(self, embedding: torch.Tensor, spec: GenerationSpec) -> torch.Tensor:
        """The first prediction under ``embedding``, flattened, in float32."""
        d = self.denoiser
        start = dataclasses.replace(spec, seed=0)
        latents, _ = d.initial_latents(start)
        first = d.scheduler(start).timesteps[0]
        return d.predict(latents, first, embedding.to(d.device), start).flatten().float()


@dataclass(frozen=True, slots=True)
class EffectAt:
    """A prompt's effect on the prediction at one point of a trajectory, and the empty
    prompt's prediction there that it is measured from."""

    blank: torch.Tensor
    effect: torch.Tensor  # flattened, float64

    @property
    def nbytes(self) -> int:
        return self.blank.nbytes + self.effect.nbytes


class PromptEffect(FirstStep):
    """What the prompt changes in the denoiser's first prediction: ``FirstStep``'s prediction
    less the empty prompt's, from the same noise. The noise's own part, which every prompt of a
    bucket shares, made every pair of first predictions alike (0.96 to 1.0), so a changed
    shape, which moves the prediction only at the shape's edges, ranked like a rewording; the
    difference keeps only the prompt's part. Longer than ``MAX_FLOATS``, it is count-sketched
    (each position added, with a fixed random sign, to one of ``MAX_FLOATS`` fixed random
    slots), which keeps inner products in expectation and every position's contribution, where
    averaging neighbours washed a shape's corners out."""

    name = PROMPT_EFFECT

    def __init__(self, denoiser: Denoiser, blank: Callable[[], torch.Tensor]) -> None:
        super().__init__(denoiser)
        self.blank = blank  # the empty prompt's embedding, encoded as every prompt is
        self._blank_predictions: dict[tuple[object, ...], torch.Tensor] = {}

    def vector(self, embedding: torch.Tensor, positions: int,
               spec: GenerationSpec) -> np.ndarray:
        effect = self.prediction(embedding, spec) - self._blank_prediction(spec)
        if effect.numel() > MAX_FLOATS:
            slots, signs = _sketch(effect.numel())
            effect = torch.zeros(MAX_FLOATS).index_add_(0, slots, effect.cpu() * signs)
        return unit(effect)

    @torch.no_grad()
    def agreement(self, latents: torch.Tensor, step: int, mine: torch.Tensor,
                  theirs: torch.Tensor, spec: GenerationSpec) -> float:
        """How alike two prompts (their embeddings) pull a trajectory at ``step``, where it
        stands at ``latents``: the cosine of their effects on the prediction (each less the
        empty prompt's). A reused trajectory switches prompts there; where the new prompt
        pulls elsewhere (another shape, colour or place), what the reused steps drew already
        decides against it."""
        return self.check(latents, step, theirs, mine, spec)[1]

    @torch.no_grad()
    def check(self, latents: torch.Tensor, step: int, theirs: torch.Tensor,
              mine: torch.Tensor, spec: GenerationSpec) -> tuple[EffectAt, float]:
        """``agreement``, with the source's side of it (``theirs``' effect), which every
        request checked against the same checkpoint shares: the three predictions in one
        forward."""
        blank, source, own = self.predictions_at(latents, step, [self.blank(), theirs, mine],
                                                 spec)
        # A row of the forward's output is a view of all three: the kept side owns its own.
        kept = EffectAt(blank.clone(), (source - blank).flatten().double())
        return kept, _cosine((own - blank).flatten().double(), kept.effect)

    @torch.no_grad()
    def agreement_with(self, theirs: EffectAt, latents: torch.Tensor, step: int,
                       mine: torch.Tensor, spec: GenerationSpec) -> float:
        """``agreement`` with the source's side already known: one prediction."""
        (own,) = self.predictions_at(latents, step, [mine], spec)
        return _cosine((own - theirs.blank).flatten().double(), theirs.effect)

    @torch.no_grad()
    def predictions_at(self, latents: torch.Tensor, step: int,
                       embeddings: list[torch.Tensor], spec: GenerationSpec
                       ) -> list[torch.Tensor]:
        """The prediction at ``step`` from ``latents`` under each embedding. One forward where
        the texts can share one (one length, or a family that pads texts under a mask): a row
        of a batch costs a fraction of a lone forward, and the encode worker's checks run on
        the cores the denoise workers use. The rows may differ from lone ones in the last bit;
        a cosine compared with a threshold does not see it."""
        d = self.denoiser
        t = d.scheduler(spec).timesteps[step].reshape(1)
        latents = latents.to(d.device)
        texts = [e.to(d.device) for e in embeddings]
        if not d.pads_text and len({e.shape[1] for e in texts}) > 1:
            return [d.predict(latents, t, e, spec) for e in texts]
        embeds, mask = pad_texts(texts)
        rows = latents.expand(len(texts), *latents.shape[1:])
        return list(d.predict(rows, t, embeds, spec, text_mask=mask).split(1))

    def _blank_prediction(self, spec: GenerationSpec) -> torch.Tensor:
        # One per geometry a worker meets (the bucket's shape, steps and first step).
        geometry = (spec.width, spec.height, spec.num_frames, spec.num_inference_steps,
                    spec.first_step)
        if geometry not in self._blank_predictions:
            self._blank_predictions[geometry] = self.prediction(self.blank(), spec)
        return self._blank_predictions[geometry]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


@functools.cache
def _sketch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot and sign of each of ``length`` positions, the same in every process."""
    generator = torch.Generator().manual_seed(SKETCH_SEED)
    slots = torch.randint(0, MAX_FLOATS, (length,), generator=generator)
    signs = torch.randint(0, 2, (length,), generator=generator).float() * 2 - 1
    return slots, signs


def prompt_view(name: str, denoiser: Callable[[], Denoiser],
                blank: Callable[[], torch.Tensor] | None = None) -> PromptView:
    """The view the model card's ``reuse_vector`` names; ``denoiser`` loads the DiT, which
    the denoiser's views need, and ``blank`` encodes the empty prompt, which the prompt's
    effect is measured from."""
    if name == TEXT_MEAN:
        return MeanPooled()
    if name == FIRST_STEP:
        return FirstStep(denoiser())
    if name == PROMPT_EFFECT and blank is not None:
        return PromptEffect(denoiser(), blank)
    raise ReuseViewError(f"model card: reuse_vector is {name!r}; this server makes "
                         f"{', '.join(VIEWS)}"
                         + (" (the prompt's effect: for a model whose texts encode alone)"
                            if name == PROMPT_EFFECT else ""))
