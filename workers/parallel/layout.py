"""How a denoise group splits each forward's sequence, checked against the model at start-up:
the settings as diffusers' ``ContextParallelConfig``, and the name keys carry for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from cachesvc.settings import DenoiseParallelSettings

SETTING = "workers.denoise_parallel"


class ParallelLayoutError(ValueError):
    """The settings ask for a split the served model cannot take; names the setting."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    ulysses: int = 1
    ring: int = 1
    ulysses_anything: bool = False

    @classmethod
    def of(cls, settings: DenoiseParallelSettings) -> ParallelLayout:
        return cls(settings.ulysses, settings.ring, settings.ulysses_anything)

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring

    @property
    def name(self) -> str:
        """What keys call it ("" for one rank, whose keys stay those of a lone worker)."""
        if self.ranks == 1:
            return ""
        parts = [f"{kind}{degree}" for kind, degree in (("ulysses", self.ulysses),
                                                         ("ring", self.ring)) if degree > 1]
        return "-".join(parts + (["anything"] if self.ulysses_anything else []))

    def check(self, transformer: Any, tokens: int) -> None:
        """Refuse, naming the setting, a split ``transformer`` cannot take at a request of
        ``tokens`` image tokens (the served model's default geometry)."""
        heads = int(transformer.config.num_attention_heads)
        if heads % self.ulysses and not self.ulysses_anything:
            raise ParallelLayoutError(
                f"{SETTING}.ulysses", f"the model's {heads} attention heads do not divide "
                f"among {self.ulysses} ranks; set a degree that divides {heads}, or "
                f"{SETTING}.ulysses_anything")
        if getattr(type(transformer), "_cp_plan", None) is None:
            raise ParallelLayoutError(SETTING, f"{type(transformer).__name__} has no context "
                                      "parallel plan in diffusers: its forwards cannot split")
        if _splits_texts(transformer) and not self.ulysses_anything:
            raise ParallelLayoutError(
                f"{SETTING}.ulysses_anything", f"{type(transformer).__name__} splits its "
                "texts too, whose lengths vary from request to request: a group serving it "
                "needs ulysses_anything (and ring 1)")
        if tokens % self.ranks and not self.ulysses_anything:
            raise ParallelLayoutError(
                SETTING, f"the default request's {tokens} image tokens do not split into "
                f"{self.ranks} equal parts (ulysses {self.ulysses} x ring {self.ring}); set "
                f"a split that divides them, or {SETTING}.ulysses_anything")

    def splits(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` image tokens splits into this layout's parts."""
        return self.ulysses_anything or tokens % self.ranks == 0

    def enable(self, transformer: Any) -> None:
        """Split ``transformer``'s forwards over the process group (which must have started)
        as diffusers' context parallelism does."""
        from diffusers import ContextParallelConfig

        with _cpu_devices_counted():
            transformer.enable_parallelism(config=ContextParallelConfig(
                ulysses_degree=self.ulysses, ring_degree=self.ring,
                ulysses_anything=self.ulysses_anything))


def _splits_texts(transformer: torch.nn.Module) -> bool:
    """Whether the model's plan splits its text tokens across ranks, as it does its image's."""
    plan = getattr(type(transformer), "_cp_plan", None) or {}
    return any(isinstance(inputs, dict) and "encoder_hidden_states" in inputs
               for inputs in plan.values())


@contextmanager
def _cpu_devices_counted() -> Iterator[None]:
    """diffusers 0.42 places rank r on accelerator ``r % device_count()``, which divides by
    zero on a machine without one: there the CPU counts as the one device every rank uses."""
    if torch.accelerator.device_count():
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        yield
