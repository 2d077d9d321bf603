"""How a denoise group splits each forward, checked against the model at start-up: its
sequence (the settings as diffusers' ``ContextParallelConfig``), or its rows; and the name
keys carry for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from config.settings import DenoiseParallelSettings

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
    rows: int = 1  # or ranks taking each a part of a forward's rows

    @classmethod
    def of(cls, settings: DenoiseParallelSettings) -> ParallelLayout:
        return cls(settings.ulysses, settings.ring, settings.ulysses_anything, settings.rows)

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring * self.rows

    @property
    def sequence_ranks(self) -> int:
        """Ranks a forward's sequence is split over (1: each computes whole rows)."""
        return self.ulysses * self.ring

    @property
    def name(self) -> str:
        """What keys call it: "" where each row is computed whole on one rank, as on a lone
        worker (whose keys it keeps: the row proof holds a row's bits to its bits alone)."""
        if self.sequence_ranks == 1:
            return ""
        parts = [f"{kind}{degree}" for kind, degree in (("ulysses", self.ulysses),
                                                         ("ring", self.ring)) if degree > 1]
        return "-".join(parts + (["anything"] if self.ulysses_anything else []))

    def check(self, transformer: Any, tokens: int) -> None:
        """Refuse, naming the setting, a split ``transformer`` cannot take at a request of
        ``tokens`` image tokens (the served model's default geometry)."""
        if self.sequence_ranks == 1:
            return  # any model computes whole rows
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
        if self.ring > 1:
            raise ParallelLayoutError(
                f"{SETTING}.ring", "ring attention needs an attention backend that returns "
                "its log-sum-exp, and diffcache runs the native one: use ulysses")
        if not self.cuts(tokens):
            raise ParallelLayoutError(
                SETTING, f"the default request's {tokens} image tokens do not split into "
                f"{self.sequence_ranks} equal parts (ulysses {self.ulysses} x ring "
                f"{self.ring}); set a split that divides them, or {SETTING}.ulysses_anything")

    @property
    def token_parts(self) -> int:
        """Equal parts a row's image tokens must split into (1: any number will do)."""
        return 1 if self.ulysses_anything else self.sequence_ranks

    def cuts(self, tokens: int) -> bool:
        """Whether a row of ``tokens`` image tokens splits as this layout splits it."""
        return tokens % self.token_parts == 0

    def row_parts(self, rows: int) -> list[slice]:
        """Which of a forward's ``rows`` each rank computes where rows are split: in order,
        rank 0 first, as even as may be (a rank past the last row gets none)."""
        each = -(-rows // self.ranks)
        return [slice(min(rows, r * each), min(rows, (r + 1) * each))
                for r in range(self.ranks)]

    def enable(self, transformer: Any) -> None:
        """Split ``transformer``'s forwards' sequence over the process group (which must have
        started) as diffusers' context parallelism does; nothing where rows are split."""
        from diffusers import ContextParallelConfig

        if self.sequence_ranks == 1:
            return

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
