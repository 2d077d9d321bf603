"""LoRA adapters applied row by row inside a shared forward.

peft's layers apply the adapters that are active for the whole model. Here they stay disabled
(each layer computes its base product alone) and a hook after each LoRA layer adds, for each
group of rows of one adapter set, that set's low-rank updates in its order, exactly as peft
0.21.2's ``Linear.forward`` adds the active adapters' for a request alone: the input cast to
the adapter's dtype, ``lora_B(lora_A(dropout(x))) * scaling`` added to the result, the result
back in its dtype. So rows of several adapter sets, and of none, share the base forward, and
each row is bit for bit the request run alone with its set (``rows_apart`` keeps each row's
products its own).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workers.engine.forward_rows import RowAdapters, active


class AdapterRows:
    """The hooks that apply each row's adapters on a denoiser's LoRA layers."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self._hooked: set[int] = set()

    def hook_new_layers(self) -> None:
        """Hook the LoRA layers loading an adapter added (peft wraps a linear layer the first
        time an adapter targets it) and keep peft's own application off."""
        from peft.tuners.lora import LoraLayer

        for module in self.transformer.modules():
            if isinstance(module, LoraLayer) and id(module) not in self._hooked:
                module.register_forward_hook(_add_row_updates)
                self._hooked.add(id(module))
        if self._hooked:
            self.transformer.disable_lora()  # type: ignore[operator]


def _scaling(layer: Any, name: str, scale: float) -> float:
    """peft's ``LoraLayer.set_scale`` of ``name`` at ``scale``."""
    if layer.use_rslora.get(name, False):
        return float(scale * layer.lora_alpha[name] / math.sqrt(layer.r[name]))
    return float(scale * layer.lora_alpha[name] / layer.r[name])


def _cast(layer: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """peft's ``_cast_input_dtype``: the input in the adapter's dtype, unless casting is off."""
    if not getattr(layer, "cast_input_dtype_enabled", True) or x.dtype == dtype:
        return x
    return x.to(dtype=dtype)


def _add_row_updates(layer: Any, args: tuple[Any, ...], result: torch.Tensor) -> torch.Tensor:
    forward = active()
    if forward is None or not any(forward.adapters[r] for r in forward.current):
        return result
    x = args[0]
    groups: dict[RowAdapters, list[int]] = {}
    for j, r in enumerate(forward.current):
        if forward.adapters[r]:
            groups.setdefault(forward.adapters[r], []).append(j)
    dtype = result.dtype
    whole = len(groups) == 1 and len(next(iter(groups.values()))) == result.shape[0]
    for adapters, rows in groups.items():
        index = None if whole else torch.tensor(rows, device=result.device)
        part = result if index is None else result.index_select(0, index)
        inputs = x if index is None else x.index_select(0, index)
        for name, scale in adapters:
            if name not in layer.lora_A:
                continue  # as peft skips an adapter that does not target this layer
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            inputs = _cast(layer, inputs, lora_a.weight.dtype)
            part = part + lora_b(lora_a(layer.lora_dropout[name](inputs))) \
                * _scaling(layer, name, scale)
        part = part.to(dtype)
        result = part if index is None else result.index_copy(0, index, part)
    return result
