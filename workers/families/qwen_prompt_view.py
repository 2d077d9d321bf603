"""How a Qwen-Image denoiser reads a prompt, as approximate reuse compares prompts: the values
that one of its blocks' joint attention takes from the text, max-pooled over the positions.
The denoiser learnt which words change the picture (a colour, a shape); the text encoder's
mean does not tell "a red circle" from "a green circle" any better than from a rewording."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch.nn import functional

from encoders.text import text_rows, unit

# QwenImageTransformer2DModel's: its txt_norm (RMSNorm) and every block's LayerNorms.
EPS = 1e-6


class ReuseViewError(ValueError):
    """The model card names a block the transformer does not have."""


def _tensors(component: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` from a component's safetensors files (one or sharded), loading no other
    weight: a full-size denoiser need not fit in an encode worker."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(component.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name).to(torch.float64)
    missing = sorted(set(names) - set(found))
    if missing:
        raise ReuseViewError(f"{component}: no tensors {', '.join(missing)} "
                             f"(model.reuse_layer names a block it lacks?)")
    return found


class QwenTextValues:
    """Block ``layer``'s attention values of the text, as the block computes them before its
    timestep modulation (which no prompt vector can know): ``add_v_proj`` of the LayerNorm of
    ``txt_in(txt_norm(embedding))``. Its maximum over the positions keeps a word's mark
    that a mean over a dozen positions dilutes."""

    def __init__(self, directory: Path, layer: int) -> None:
        self.name = f"qwen-text-values:{layer}"
        block = f"transformer_blocks.{layer}.attn.add_v_proj"
        w = _tensors(directory / "transformer", [
            "txt_norm.weight", "txt_in.weight", "txt_in.bias", f"{block}.weight",
            f"{block}.bias"])
        self._norm = w["txt_norm.weight"]
        self._into = (w["txt_in.weight"], w["txt_in.bias"])
        self._values = (w[f"{block}.weight"], w[f"{block}.bias"])

    def vector(self, embedding: torch.Tensor, positions: int) -> np.ndarray:
        x = text_rows(embedding, positions)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self._norm
        x = functional.linear(x, *self._into)
        x = functional.layer_norm(x, (x.shape[-1],), eps=EPS)
        return unit(functional.linear(x, *self._values).max(dim=0).values)
