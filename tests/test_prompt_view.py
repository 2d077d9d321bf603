"""The vectors approximate reuse compares prompts by: the denoiser's first prediction and the
prompt's effect on it, the same for any seed and any family, capped in size; the text encoder's
mean; a clear error for a card naming none; and vectors of two views never share a bucket."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from encoders.text import MeanPooled, prompt_vector
from keys import (
    ChainLink,
    GenerationSpec,
    KeyKind,
    OutputFormat,
    PromptSegment,
    StoreKey,
    reuse_bucket,
)
from workers.families import family_of
from workers.families.base import CPU
from workers.stages.approximate import Agreement
from workers.stages.prompt_view import (
    FIRST_STEP,
    MAX_FLOATS,
    PROMPT_EFFECT,
    TEXT_MEAN,
    FirstStep,
    PromptEffect,
    ReuseViewError,
    prompt_view,
)


def shaped(width: int = 32, height: int = 32, seed: int = 1) -> GenerationSpec:
    return GenerationSpec.create(request_id="r", tenant="t", prompt="-", width=width,
                                 height=height, num_frames=1, num_inference_steps=4,
                                 guidance_scale=4.0, seed=seed, output_format=OutputFormat.NPY)


@pytest.mark.parametrize("name", [FIRST_STEP, PROMPT_EFFECT])
@pytest.mark.parametrize("folder", ["model_dir", "qwen_model_dir"])
def test_the_first_step_is_the_prompts_and_not_the_seeds(
        folder: str, name: str, request: pytest.FixtureRequest) -> None:
    directory: Path = request.getfixturevalue(folder)
    family = family_of(directory)
    text = family.text_encoder(directory, CPU)
    denoiser = family.denoiser(directory, CPU)
    view = prompt_view(name, lambda: denoiser, lambda: text.encode(text.tokenize("")))
    assert isinstance(view, FirstStep) and view.name == name
    spec = shaped()
    red = prompt_vector(text, view, "a red fox in the snow", spec)
    again = prompt_vector(text, view, "a red fox in the snow", dataclasses.replace(spec, seed=9))
    blue = prompt_vector(text, view, "a blue whale at sea", spec)
    assert red.dtype == np.float32
    assert red.size == min(MAX_FLOATS, int(np.prod(denoiser.latent_shape(spec))))
    assert np.linalg.norm(red) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(red, again)  # every request of a bucket starts from seed 0's noise
    assert not np.allclose(red, blue)


def test_a_large_first_prediction_is_brought_down(qwen_model_dir: Path) -> None:
    family = family_of(qwen_model_dir)
    text = family.text_encoder(qwen_model_dir, CPU)
    denoiser = family.denoiser(qwen_model_dir, CPU)
    spec = shaped(width=256, height=256)
    assert int(np.prod(denoiser.latent_shape(spec))) > MAX_FLOATS
    for view in (FirstStep(denoiser),
                 PromptEffect(denoiser, lambda: text.encode(text.tokenize("")))):
        vector = prompt_vector(text, view, "a red fox", spec)
        assert vector.size == MAX_FLOATS
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


def test_the_prompts_effect_leaves_out_what_every_prompt_shares(qwen_model_dir: Path) -> None:
    """Measured from the empty prompt's prediction: the empty prompt itself has no effect,
    and a prompt's effect is its prediction less the empty one's, whatever the batch."""
    family = family_of(qwen_model_dir)
    text = family.text_encoder(qwen_model_dir, CPU)
    denoiser = family.denoiser(qwen_model_dir, CPU)
    blank = text.encode(text.tokenize(""))
    view = PromptEffect(denoiser, lambda: blank)
    spec = shaped()
    assert not np.any(prompt_vector(text, view, "", spec))
    fox = text.encode(text.tokenize("a red fox"))
    effect = view.prediction(fox, spec) - view.prediction(blank, spec)
    np.testing.assert_allclose(view.vector(fox, 3, spec),
                               (effect / effect.norm()).numpy(), atol=1e-6)


def test_a_repeated_agreement_check_reuses_the_sources_side(qwen_model_dir: Path) -> None:
    """The check against one source's checkpoint gives the cosine of lone predictions (its
    three share a forward, padded texts under a mask),
    a first check costs the denoiser one forward of its three rows, and a second request
    checked against it one forward of one row."""
    family = family_of(qwen_model_dir)
    text = family.text_encoder(qwen_model_dir, CPU)
    denoiser = family.denoiser(qwen_model_dir, CPU)
    blank = text.encode(text.tokenize(""))
    view = PromptEffect(denoiser, lambda: blank)
    embedded = {p: text.encode(text.tokenize(p))
                for p in ("a red fox", "a red fox in snow", "a blue whale")}
    agreement = Agreement(view, 0.5, lambda _, prompt: embedded[prompt])
    source = dataclasses.replace(shaped(), request_id="source", schedule=(
        PromptSegment("a red fox", "", 4),))
    latents, _ = denoiser.initial_latents(source)
    checkpoint = StoreKey(tenant="t", kind=KeyKind.CHECKPOINT, ident="0" * 64)
    forwards: list[int] = []  # the rows of each
    original = denoiser.predict

    def counted(latents: torch.Tensor, *args: object, **kwargs: object) -> object:
        forwards.append(latents.shape[0])
        return original(latents, *args, **kwargs)

    denoiser.predict = counted  # type: ignore[method-assign]
    for prompt, rows in (("a red fox in snow", [3]), ("a blue whale", [1])):
        mine = embedded[prompt]
        whole = view.agreement(latents, 2, mine, embedded["a red fox"], source)
        lone = [view.predictions_at(latents, 2, [e], source)[0]
                for e in (blank, embedded["a red fox"], mine)]
        a, b = ((p - lone[0]).flatten().double() for p in lone[1:])
        assert whole == pytest.approx(float(a @ b / (a.norm() * b.norm())), abs=1e-4)
        forwards.clear()
        assert agreement.holds(checkpoint, latents, 2, mine, source, source) == (whole >= 0.5)
        assert forwards == rows


def test_the_text_mean_is_the_encoders_embedding_averaged(qwen_model_dir: Path) -> None:
    text = family_of(qwen_model_dir).text_encoder(qwen_model_dir, CPU)
    tokens = text.tokenize("a red fox")
    embedding = text.encode(tokens)
    positions = text.text_positions(tokens, embedding)
    view = prompt_view(TEXT_MEAN, lambda: pytest.fail("the text mean loads no denoiser"))
    assert isinstance(view, MeanPooled)
    mean = embedding[0, :positions].double().mean(dim=0).numpy()
    np.testing.assert_allclose(view.vector(embedding, positions, shaped()),
                               mean / np.linalg.norm(mean), atol=1e-6)


def test_a_card_naming_another_vector_is_refused_with_the_field() -> None:
    with pytest.raises(ReuseViewError, match=r"reuse_vector is 'clip'.*text-mean"):
        prompt_view("clip", lambda: pytest.fail("nothing to load"))
    # A model whose texts are read with an image has no empty prompt's prediction alone.
    with pytest.raises(ReuseViewError, match=r"reuse_vector is 'denoiser-prompt-effect'"):
        prompt_view(PROMPT_EFFECT, lambda: pytest.fail("nothing to load"))


def test_vectors_of_two_views_never_share_a_bucket() -> None:
    root = ChainLink("tenant", 0, "ab" * 32)
    assert reuse_bucket(root, None, 4.0, TEXT_MEAN) != reuse_bucket(root, None, 4.0, FIRST_STEP)
    assert reuse_bucket(root, None, 4.0, FIRST_STEP) == reuse_bucket(root, None, 4.0,
                                                                     FIRST_STEP)
