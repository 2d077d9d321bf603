"""Entries' payloads as typed tensors: the one place the codec meets torch. Only the modules
that hold tensors import it; the API handles byte entries and never loads torch."""

from __future__ import annotations

import torch

from cachesvc.codec import TensorSpec


def typed_view(raw: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec`` viewing the uint8 tensor ``raw`` from ``offset``; no copy."""
    flat = raw[offset:offset + spec.payload_bytes]
    dtype: torch.dtype = getattr(torch, spec.dtype)  # TensorSpec admits torch's names alone
    return flat.view(dtype).view(spec.shape)
