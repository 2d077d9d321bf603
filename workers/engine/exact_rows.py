"""Batched forwards whose every row is what that row computes alone.

Measured on CPU (float32, one thread per op; README "Batched rows"): a matrix multiply rounds
a row differently depending on how many rows it is given (one, two or three, four or more), and
a convolution depends on the batch it sees. The sequence-sized multiplies and attention of a
DiT already see many rows at batch 1, so they are batch-invariant; what is not are the
per-sample layers (the timestep embedding, the modulation, the patch convolution), and
attention over texts padded to a common length under a key mask (not inert: the kernel sums a
longer row in another order). Inside ``rows_apart`` those run one sample at a time, attention
over only the positions its mask keeps: a few small kernels more per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch.overrides import TorchFunctionMode

# Each function's input rank when it carries a batch dimension.
_BATCHED_RANK = {F.linear: 2, F.conv1d: 3, F.conv2d: 4, F.conv3d: 5}
_SDPA_ARGS = ("query", "key", "value", "attn_mask")


class rows_apart(TorchFunctionMode):  # noqa: N801 - used as a context manager, like no_grad
    """Within the block, a linear layer given (batch, features), a convolution given a batch
    of samples and attention under a boolean key mask compute each sample on its own, so their
    rows match batch 1 bit for bit."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
            mask = named.pop("attn_mask", None)
            if mask is not None and mask.dtype == torch.bool and mask.shape[1:3] == (1, 1):
                return _attention_per_row(func, named.pop("query"), named.pop("key"),
                                          named.pop("value"), mask, named)
        rank = _BATCHED_RANK.get(func)
        if rank is not None:
            x = args[0]
            if x.dim() == rank and x.shape[0] > 1:
                return torch.cat([func(x[i:i + 1], *args[1:], **kwargs)
                                  for i in range(x.shape[0])])
        return func(*args, **kwargs)


def _attention_per_row(sdpa: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any]
                       ) -> torch.Tensor:
    """Attention under a key mask (text padded to a common length), computed row by row over
    only the positions the mask keeps: the very call that row makes alone, unpadded. The
    outputs of padded positions are zero; nothing reads them but the padding itself."""
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        keep = mask[i, 0, 0]
        rows = sdpa(q[i:i + 1, :, keep], k[i:i + 1, :, keep], v[i:i + 1, :, keep], **kwargs)
        out[i:i + 1, :, keep] = rows
    return out
