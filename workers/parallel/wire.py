"""How rank 0 of a denoise group hands each forward's inputs to the group's other ranks: a JSON
header naming the tensors that follow (the request as its record holds it), then the tensors,
each by ``torch.distributed.broadcast``; and, where rows are split, how each rank's part of the
output comes back. Nothing is unpickled; an empty header says stop."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.engine.forward_inputs import ForwardInputs
from workers.queue.spec_json import spec_from_json, spec_to_json

_TENSORS = ("latents", "timesteps", "embeds", "mask", "condition")


@dataclass(frozen=True, slots=True)
class Wire:
    """The broadcasts of one group, through ``device`` (the CPU for gloo, this rank's GPU for
    NCCL), from rank 0."""

    device: torch.device

    def send(self, inputs: ForwardInputs | None) -> None:
        """``inputs`` to every other rank (None: the group stops)."""
        if inputs is None:
            self._header(b"")
            return
        tensors = {name: getattr(inputs, name) for name in _TENSORS
                   if getattr(inputs, name) is not None}
        self._header(json.dumps({
            "spec": spec_to_json(inputs.spec),
            "tensors": [[name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                        for name, t in tensors.items()]}).encode())
        for t in tensors.values():
            dist.broadcast(t.detach().to(self.device).contiguous(), src=0)

    def receive(self) -> ForwardInputs | None:
        """The next forward's inputs from rank 0 (None: the group stops)."""
        raw = self._header(None)
        if not raw:
            return None
        header = json.loads(raw)
        tensors: dict[str, torch.Tensor] = {}
        for name, shape, dtype in header["tensors"]:
            if name not in _TENSORS or not isinstance(getattr(torch, dtype, None),
                                                      torch.dtype):
                raise ValueError(f"denoise group: rank 0 sent an unknown tensor {name!r} "
                                 f"of dtype {dtype!r}")
            tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            dist.broadcast(tensors[name], src=0)
        return ForwardInputs(spec=spec_from_json(header["spec"]), latents=tensors["latents"],
                             timesteps=tensors["timesteps"], embeds=tensors["embeds"],
                             mask=tensors.get("mask"), condition=tensors.get("condition"))

    def give(self, out: torch.Tensor) -> None:
        """This rank's part of a forward's output, to rank 0."""
        dist.send(out.detach().to(self.device).contiguous(), dst=0)

    def take(self, latents: torch.Tensor, dtype: torch.dtype, rows: slice,
             rank: int) -> torch.Tensor:
        """``rank``'s part of a forward's output: its ``rows``, shaped as their ``latents``,
        in ``dtype``."""
        part = torch.empty((rows.stop - rows.start, *latents.shape[1:]), dtype=dtype,
                           device=self.device)
        dist.recv(part, src=rank)
        return part.to(latents.device)

    def _header(self, raw: bytes | None) -> bytes:
        """``raw`` from rank 0 (None on the others: what it sent)."""
        size = torch.tensor([-1 if raw is None else len(raw)], dtype=torch.int64,
                            device=self.device)
        dist.broadcast(size, src=0)
        body = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
                if raw else torch.empty(int(size), dtype=torch.uint8, device=self.device))
        if int(size):
            dist.broadcast(body, src=0)
        return bytes(body.cpu().numpy().tobytes())
