"""Step checkpoints: everything a denoising trajectory needs to continue bit-identically.

A checkpoint after step k holds the latents, the scheduler's whole stepping state (what the
family names: a multistep scheduler keeps its last model outputs, their timesteps, the last
sample and its order counters; a first-order one only its step index), the noise generator's
state, for the approximate CFG
tier the guidance residual in use, and for a step cache its hooks' state per guidance branch.
It is stored as safetensors (tensors plus string metadata, never pickle) under the chain link
``h(k)``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from workers.engine import hook_state
from workers.engine.hook_state import HookStateError, RunHookState

# 2: the scheduler's tensors are named in the metadata, which fields they are being the
# family's to say (``SchedulerFields``).
FORMAT = "diffcache-checkpoint-2"
_CPU = torch.device("cpu")


class CheckpointError(ValueError):
    """A stored checkpoint cannot be read back, or does not fit this scheduler."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    latents: torch.Tensor
    scheduler: dict[str, Any]  # ``SchedulerFields.capture``: attribute -> tensor, list, int
    rng: torch.Tensor  # torch.Generator.get_state()
    cfg_residual: torch.Tensor | None
    compute_s: float  # denoising seconds from step 0 to here: what resuming here saves
    hooks: RunHookState  # the step cache's hook state; empty without a policy

    @staticmethod
    def capture(step: int, latents: torch.Tensor, scheduler: dict[str, Any],
                rng: torch.Generator, cfg_residual: torch.Tensor | None, compute_s: float,
                hooks: RunHookState) -> Checkpoint:
        """A snapshot that later steps cannot change (the loop goes on while it is written);
        ``scheduler`` is already a copy (``SchedulerFields.capture``)."""
        # A hook state is only ever replaced, never changed in place (``RunStepCache``), so
        # the dict of branches is all that must be copied.
        return Checkpoint(step, latents.clone(), scheduler, rng.get_state(),
                          None if cfg_residual is None else cfg_residual.clone(), compute_s,
                          dict(hooks))

    def to_bytes(self) -> bytes:
        tensors: dict[str, torch.Tensor] = {"latents": self.latents, "rng": self.rng}
        meta = {"format": FORMAT, "step": str(self.step), "compute_s": repr(self.compute_s)}
        if self.cfg_residual is not None:
            tensors["cfg_residual"] = self.cfg_residual
        if self.hooks:
            tree, hook_tensors = hook_state.encode(self.hooks, "hooks")
            meta["hooks"] = json.dumps(tree)
            tensors.update(hook_tensors)
        for name, value in self.scheduler.items():
            if isinstance(value, list):
                meta[f"len:{name}"] = str(len(value))
                tensors.update({f"{name}.{i}": t for i, t in enumerate(value) if t is not None})
            elif isinstance(value, torch.Tensor):
                meta[f"tensor:{name}"] = ""
                tensors[name] = value
            elif value is None:
                meta[f"none:{name}"] = ""
            else:
                meta[f"int:{name}"] = str(int(value))
        return save_safetensors({k: t.detach().to("cpu").contiguous()
                                 for k, t in tensors.items()}, metadata=meta)

    @staticmethod
    def from_bytes(data: bytes) -> Checkpoint:
        try:
            tensors = load_safetensors(data)
            meta = _metadata(data)
        except Exception as exc:  # safetensors raises its own error types for bad bytes
            raise CheckpointError(f"not a safetensors checkpoint: {exc}") from exc
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not {FORMAT}")
        state: dict[str, Any] = {}
        for key, value in meta.items():
            kind, _, name = key.partition(":")
            if kind == "len":
                state[name] = [tensors.get(f"{name}.{i}") for i in range(int(value))]
            elif kind == "none":
                state[name] = None
            elif kind == "int":
                state[name] = int(value)
            elif kind == "tensor":
                state[name] = tensors[name]
        try:
            hooks = (hook_state.decode(json.loads(meta["hooks"]), tensors, _CPU)
                     if "hooks" in meta else {})
        except (HookStateError, ValueError) as exc:
            raise CheckpointError(f"unreadable step-cache state: {exc}") from exc
        return Checkpoint(int(meta["step"]), tensors["latents"], state, tensors["rng"],
                          tensors.get("cfg_residual"), float(meta["compute_s"]), hooks)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer: its header is a little-endian u64 length,
    then that many bytes of JSON (``load`` returns the tensors only)."""
    (length,) = struct.unpack("<Q", data[:8])
    return dict(json.loads(data[8:8 + length]).get("__metadata__") or {})
