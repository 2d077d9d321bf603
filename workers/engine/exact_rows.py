"""Batched forwards whose every row is what that row computes alone.

Measured on CPU (float32, one thread per op; README "The denoise engine"): a matrix multiply
rounds a row differently depending on how many rows it is given, and which sizes round alike
depends on the CPU (on an AVX2 machine, only the per-sample layers differed; on an AVX-512 one
with AMX, every linear layer did, the sequence-sized ones included). A convolution depends on
the batch it sees, and attention over texts padded to a common length under a key mask is not
inert (the kernel sums a longer row in another order). Inside ``rows_apart`` each of those
computes every sample as it is computed on its own: a linear layer as one product of every
row where the device rounds that as the samples alone (on an AMD EPYC, for samples of four
rows or more), else as one batched multiply of per-sample matrices (``baddbmm``: each sample's
product with its own row count), padded texts likewise in one product or cut back to their
own tokens, a convolution one sample at a time, and attention under a padding mask over only
the positions each row keeps (rows that keep the same positions together).

Which kernels round alike is a property of the device, so this is checked where it runs: the
first batched call of each shape tries the ways of computing it, cheapest first (one product of
every row; one of per-sample matrices), against its samples one at a time, and keeps the first
that gave the same bits (``_CHECKED``, keyed by everything that picks the kernel: shapes,
strides, dtype, device, and for padded texts each sample's length in order); the engine
compares its first batched forward of each
geometry with the rows alone (``row_proof``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

# Each function's input rank when it carries a batch of samples (linear layers: any rank from
# 2 up, the first dimension being the sample).
_CONV_RANK = {F.conv1d: 3, F.conv2d: 4, F.conv3d: 5}
_SDPA_ARGS = ("query", "key", "value", "attn_mask")
# Below this many multiply-adds per sample ATen's batched multiply takes a naive loop that
# rounds unlike a lone multiply: such tiny layers run one sample at a time instead.
_NAIVE_BMM_BELOW = 400
# What this device answered when a batched call of a shape was first compared, bit for bit,
# with the same samples computed one at a time: the index of the cheapest way of computing it
# batched that gave the same bits, or ALONE where none did (those samples are computed one at
# a time from then on). Keyed by everything that picks the kernel.
_CHECKED: dict[tuple[object, ...], int] = {}
ALONE = -1


class rows_apart(TorchFunctionMode):  # noqa: N801 - used as a context manager, like no_grad
    """Within the block, a linear layer, a convolution given a batch of samples, and attention
    under a boolean key mask compute each sample on its own, so their rows match batch 1 bit
    for bit.

    Texts padded to a common length (``text_mask``, (samples, length)) are cut back to each
    sample's own positions wherever a linear layer meets them: a product rounds by its row
    count, so a text's tokens must be multiplied as the text alone has them. The text stream
    is told apart by its length, which the caller keeps unlike every other sequence length
    in the forward (``pad_texts``' ``avoid``)."""

    def __init__(self, text_mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self._mask = text_mask
        self._padded = 0 if text_mask is None else text_mask.shape[1]
        self._texts: list[_Group] = []
        self._lengths: tuple[int, ...] = ()
        self._kept: torch.Tensor | None = None
        self._hold(text_mask)
        self._lengths_all = self._lengths  # every sample's, whatever a call holds
        # Each layer builds its own attention mask, of the same contents: its groups are
        # worked out once, keyed by those contents.
        self._mask_groups: dict[tuple[torch.device, tuple[int, ...], bytes], list[_Group]] = {}

    def _hold(self, text_mask: torch.Tensor | None) -> None:
        """The samples of each text length (``pad_texts`` pads at the end, so a text's
        positions are a prefix), worked out once for the forward's every layer."""
        self._kept = None if text_mask is None else text_mask.unsqueeze(-1)
        self._lengths, self._texts = (), []
        if text_mask is not None:
            lengths = text_mask.sum(dim=1).tolist()
            self._lengths = tuple(lengths)
            self._texts = [_Group(samples, length, text_mask.device)
                           for length, samples in _same(lengths).items()]

    @property
    def padded(self) -> int | None:
        """The length texts are padded to in this forward (None: they are not)."""
        return None if self._mask is None else self._padded

    def text_length(self, row: int) -> int | None:
        """The forward's sample ``row``'s own text length (None: texts are not padded)."""
        return None if self._mask is None else self._lengths_all[row]

    @contextmanager
    def narrowed(self, rows: list[int]) -> Iterator[None]:
        """Within the block, the calls hold only ``rows`` of the forward's samples (a
        block or module run on some of them): their texts are those rows' texts."""
        if self._mask is None:
            yield
            return
        held = self._kept, self._lengths, self._texts
        self._hold(self._mask[rows])
        try:
            yield
        finally:
            self._kept, self._lengths, self._texts = held

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            if x.dim() >= 2 and x.shape[0] > 1:
                weight = args[1] if len(args) > 1 else kwargs["weight"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if self._kept is not None and x.dim() == 3 and x.shape[1] == self._padded:
                    return _linear_of_texts(x, weight, bias, self._texts, self._kept,
                                            self._lengths)
                return _linear_per_sample(x, weight, bias)
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            named = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
            mask = named.pop("attn_mask", None)
            if mask is not None and mask.dtype == torch.bool and mask.shape[1:3] == (1, 1):
                return _attention_of_groups(func, named.pop("query"), named.pop("key"),
                                            named.pop("value"), self._groups_of(mask), named)
        rank = _CONV_RANK.get(func)
        if rank is not None:
            x = args[0]
            if x.dim() == rank and x.shape[0] > 1:
                return torch.cat([func(x[i:i + 1], *args[1:], **kwargs)
                                  for i in range(x.shape[0])])
        return func(*args, **kwargs)

    def _groups_of(self, mask: torch.Tensor) -> list[_Group]:
        """The rows of a key mask (samples, 1, 1, keys) that keep the same positions."""
        keeps = mask[:, 0, 0].cpu().numpy()
        key = (mask.device, keeps.shape, keeps.tobytes())
        groups = self._mask_groups.get(key)
        if groups is None:
            same = _same([row.tobytes() for row in keeps])
            groups = [_Group(samples, mask[samples[0], 0, 0].clone(), mask.device)
                      for samples in same.values()]
            self._mask_groups[key] = groups
        return groups


class _Group:
    """Samples that share what they keep: a text length, or an attention mask's positions."""

    def __init__(self, samples: list[int], keep: Any, device: torch.device) -> None:
        self.samples = samples
        self.keep = keep  # a length (a prefix), or a boolean mask of positions
        self.index = torch.tensor(samples, device=device)
        # Samples next to each other are taken as a view, not gathered.
        first = samples[0]
        self.rows: slice | torch.Tensor = (
            slice(first, first + len(samples))
            if samples == list(range(first, first + len(samples))) else self.index)
        if isinstance(keep, torch.Tensor):
            self.positions = keep.nonzero().view(1, -1)


def _linear_per_sample(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of each sample of ``x`` as it is computed alone: one product of every row,
    or a (rows, in) by (in, out) product per sample in one batched multiply, whichever this
    device showed exact first."""
    samples = x.shape[0]
    x3 = x.reshape(samples, -1, x.shape[-1])
    rows, inner, outer = x3.shape[1], weight.shape[1], weight.shape[0]

    def one_at_a_time() -> torch.Tensor:
        return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(samples)])

    def per_sample_matrices() -> torch.Tensor:
        w = weight.t().expand(samples, inner, outer)
        out = (torch.bmm(x3, w) if bias is None
               else torch.baddbmm(bias.expand(samples, rows, outer), x3, w))
        return out.reshape(*x.shape[:-1], outer)

    if rows * inner * outer < _NAIVE_BMM_BELOW:
        return one_at_a_time()
    shape = ("linear", rows, inner, outer, samples, x.stride(), x.dtype, x.device,
             bias is not None, alignment(x, weight, bias))
    # One product of every row is the cheapest, and on some CPUs a row of it rounds as the
    # row's own sample does (README "The denoise engine").
    return _checked(shape, (lambda: F.linear(x, weight, bias), per_sample_matrices),
                    one_at_a_time)


# Pointer alignment beyond this many bytes picks no other kernel: cuBLASLt reads operands in
# vectors of up to 16 bytes, CPU kernels in cache lines of 64.
_ALIGNMENT_CAP = 64


def alignment(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """Each operand's pointer alignment in bytes (up to ``_ALIGNMENT_CAP``): a kernel library
    may pick another kernel, and round otherwise, for another alignment of the same shapes
    (a view into a batch starts at an offset), so a shape's verdict holds for its alignment."""
    out = []
    for t in tensors:
        address = 0 if t is None else t.data_ptr()
        out.append(_ALIGNMENT_CAP if address == 0 else min(address & -address, _ALIGNMENT_CAP))
    return tuple(out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: ``torch.equal`` takes -0.0 for 0.0 and never a NaN for itself."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def checks_made() -> int:
    """How many shapes have been checked in this process (each check computed its samples
    one at a time as well)."""
    return len(_CHECKED)


def _checked(shape: tuple[object, ...], ways: Sequence[Callable[[], torch.Tensor]],
             one_at_a_time: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``shape`` computed the cheapest of ``ways`` that the first call of ``shape`` showed
    equal to its samples computed one at a time; where none was, those samples, then and from
    then on."""
    verdict = _CHECKED.get(shape)
    if verdict is not None:
        return one_at_a_time() if verdict == ALONE else ways[verdict]()
    alone = one_at_a_time()
    verdict = next((i for i, way in enumerate(ways) if same_bits(way(), alone)), ALONE)
    _CHECKED[shape] = verdict
    if verdict == ALONE:
        log.info("a batched %s of shape %s rounds unlike its samples alone on this device: "
                 "computed one sample at a time from now on", shape[0], shape)
    return alone


def _linear_of_texts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     texts: list[_Group], kept: torch.Tensor,
                     lengths: tuple[int, ...]) -> torch.Tensor:
    """``F.linear`` of padded texts (``kept``: (samples, length, 1), their real positions),
    each over only its own positions; padded positions get zeros (nothing reads them but the
    padding itself: attention runs over kept positions only). One product of the padded
    batch where this device showed its kept rows equal to the texts' own products."""

    def padded() -> torch.Tensor:
        return F.linear(x, weight, bias).masked_fill_(~kept, 0)

    def cut() -> torch.Tensor:
        out = x.new_zeros((*x.shape[:-1], weight.shape[0]))
        for group in texts:
            length = group.keep
            if len(group.samples) == 1:
                i = group.samples[0]
                out[i, :length] = F.linear(x[i:i + 1, :length], weight, bias)[0]
            else:
                out[group.index, :length] = _linear_per_sample(x[group.index, :length],
                                                               weight, bias)
        return out

    # Each sample's length in order: where a text's rows sit in the product may matter.
    shape = ("padded texts", x.shape, x.stride(), lengths, *weight.shape, x.dtype, x.device,
             bias is not None, alignment(x, weight, bias))
    return _checked(shape, (padded,), cut)


def _same(keys: list[Any]) -> dict[Any, list[int]]:
    """The positions of each distinct key, in order."""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


def _attention_of_groups(sdpa: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, groups: list[_Group], kwargs: dict[str, Any]
                         ) -> torch.Tensor:
    """Attention under a key mask (text padded to a common length), computed over only the
    positions the mask keeps, rows that keep the same positions together: the very call each
    row makes alone, unpadded (attention without a mask is the same per row at any batch
    size). The outputs of padded positions are zero; nothing reads them but the padding."""
    out = torch.zeros_like(q)
    for group in groups:
        # Positions are taken by index, worked out once per forward: a boolean mask would
        # find them again in every one of the layers' gathers.
        kept = group.positions[0]
        if len(group.samples) == 1:
            one = slice(group.samples[0], group.samples[0] + 1)
            out[one].index_copy_(2, kept, sdpa(q[one].index_select(2, kept),
                                               k[one].index_select(2, kept),
                                               v[one].index_select(2, kept), **kwargs))
            continue
        rows = group.rows
        gq, gk, gv = (x[rows].index_select(2, kept) for x in (q, k, v))

        def one_at_a_time(gq: torch.Tensor = gq, gk: torch.Tensor = gk,
                          gv: torch.Tensor = gv) -> torch.Tensor:
            return torch.cat([sdpa(gq[j:j + 1], gk[j:j + 1], gv[j:j + 1], **kwargs)
                              for j in range(gq.shape[0])])

        def together(gq: torch.Tensor = gq, gk: torch.Tensor = gk,
                     gv: torch.Tensor = gv) -> torch.Tensor:
            return sdpa(gq, gk, gv, **kwargs)

        shape = ("attention", gq.shape, gq.stride(), gk.shape, gk.stride(), gq.dtype,
                 gq.device, tuple(sorted(kwargs.items())), alignment(gq, gk, gv))
        found = _checked(shape, (together,), one_at_a_time)
        if isinstance(rows, slice):
            out[rows].index_copy_(2, kept, found)
        else:
            out[rows.view(-1, 1), :, group.positions] = found.transpose(1, 2)
    return out


def pad_texts(texts: list[torch.Tensor],
              avoid: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Texts (1, length, dim) as one batch, padded with zeros to the longest (one more, where
    the longest is ``avoid``, the forward's other sequence length: ``rows_apart`` tells the
    text stream by its length), and the mask of their real positions; no mask when they are
    all one length."""
    longest = max(t.shape[1] for t in texts)
    if all(t.shape[1] == longest for t in texts):
        return torch.cat(list(texts)), None
    if longest == avoid:
        longest += 1
    batch = texts[0].new_zeros((len(texts), longest, *texts[0].shape[2:]))
    mask = torch.zeros((len(texts), longest), dtype=torch.bool, device=batch.device)
    for i, t in enumerate(texts):
        batch[i, :t.shape[1]] = t[0]
        mask[i, :t.shape[1]] = True
    return batch, mask
