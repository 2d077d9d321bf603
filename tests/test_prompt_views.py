"""The views approximate reuse compares prompts by: a Qwen-Image denoiser block's own values of
the text, computed from that block's weights alone, and the text encoder's mean where the
model card names no block; vectors of two views never share a bucket."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from encoders.text import MeanPooled
from keys import ChainLink, reuse_bucket
from workers.families import family_named
from workers.families.base import CPU
from workers.families.qwen_prompt_view import ReuseViewError

PROMPT = "a small red circle on the left on a blue background"


def encoded(directory: Path) -> tuple[torch.Tensor, int]:
    text = family_named("qwen-image").text_encoder(directory, CPU)
    tokens = text.tokenize(PROMPT)
    embedding = text.encode(tokens)
    return embedding, text.text_positions(tokens, embedding)


def test_a_blocks_view_is_the_values_that_block_takes_from_the_text(
        qwen_model_dir: Path) -> None:
    embedding, positions = encoded(qwen_model_dir)
    dit = QwenImageTransformer2DModel.from_pretrained(qwen_model_dir / "transformer").eval()
    family = family_named("qwen-image")
    for layer in (0, len(dit.transformer_blocks) - 1):
        view = family.prompt_view(qwen_model_dir, layer)
        with torch.no_grad():
            block = dit.transformer_blocks[layer]
            text = dit.txt_in(dit.txt_norm(embedding[0, :positions]))
            values = block.attn.add_v_proj(block.txt_norm1(text)).max(dim=0).values
        expected = (values / values.norm()).numpy()
        got = view.vector(embedding, positions)
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-6)
        assert view.name == f"qwen-text-values:{layer}"


def test_without_a_block_the_view_is_the_text_encoders_mean(qwen_model_dir: Path) -> None:
    embedding, positions = encoded(qwen_model_dir)
    view = family_named("qwen-image").prompt_view(qwen_model_dir, None)
    assert isinstance(view, MeanPooled)
    mean = embedding[0, :positions].double().mean(dim=0).numpy()
    np.testing.assert_allclose(view.vector(embedding, positions), mean / np.linalg.norm(mean),
                               atol=1e-6)
    # A family without a denoiser view (Wan) falls back to the mean whatever the card says.
    assert isinstance(family_named("wan").prompt_view(qwen_model_dir, 3), MeanPooled)


def test_a_block_the_transformer_lacks_is_named(qwen_model_dir: Path) -> None:
    with pytest.raises(ReuseViewError, match=r"transformer_blocks\.99\.attn\.add_v_proj"):
        family_named("qwen-image").prompt_view(qwen_model_dir, 99)


def test_vectors_of_two_views_never_share_a_bucket() -> None:
    root = ChainLink("tenant", 0, "ab" * 32)
    assert reuse_bucket(root, None, 4.0, "mean") != reuse_bucket(root, None, 4.0,
                                                                "qwen-text-values:3")
    assert reuse_bucket(root, None, 4.0, "mean") == reuse_bucket(root, None, 4.0, "mean")
