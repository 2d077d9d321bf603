"""A request's step-cache policy as the diffusers hook configuration that runs it: the denoiser
and the monolithic reference enable the same one, so their outputs compare bit for bit. Also
MagCache's calibration, whose ratios a model card ships."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from diffusers.models.cache_utils import CacheMixin

from keys import StepCache, StepCachePolicy


def hook_config(cache: StepCache, steps: int, attention: Sequence[str] | None = None,
                mag_ratios: Sequence[float] = ()) -> Any:
    """The ``enable_cache`` configuration of ``cache`` for a trajectory of ``steps``.
    ``attention``: the patterns of the attention modules TaylorSeer forecasts, where diffusers'
    defaults match none of the family's (they must end in ``attn``). ``mag_ratios``: the
    model's calibrated MagCache ratios (its card's), interpolated to ``steps`` by diffusers."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if cache.policy is StepCachePolicy.FIRST_BLOCK:
        return FirstBlockCacheConfig(threshold=float(cache.param("threshold")))
    if cache.policy is StepCachePolicy.TAYLORSEER:
        return TaylorSeerCacheConfig(cache_interval=int(cache.param("interval")),
                                     disable_cache_before_step=int(cache.param("warmup")),
                                     max_order=int(cache.param("max_order")),
                                     cache_identifiers=None if attention is None
                                     else list(attention))
    if cache.policy is StepCachePolicy.MAGCACHE and mag_ratios:
        return MagCacheConfig(threshold=float(cache.param("threshold")),
                              max_skip_steps=int(cache.param("max_skip")),
                              num_inference_steps=steps, mag_ratios=list(mag_ratios))
    raise ValueError(f"step_cache.policy {cache.policy.value} cannot run on this model")


def calibrate_magcache(transformer: torch.nn.Module, steps: int,
                       run: Callable[[], object]) -> list[list[float]]:
    """MagCache's published calibration: ``run()`` a trajectory of ``steps`` with the hook in
    calibration mode (it skips nothing and measures, per step, the mean ratio of the blocks'
    residual norms to the previous step's); the ratios of each guidance branch it ran.
    diffusers reports them only in a log record, at the end of each branch's trajectory."""
    from diffusers import MagCacheConfig

    found: list[list[float]] = []

    class Ratios(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith(_CALIBRATED):
                found.append([float(r) for r in json.loads(message[len(_CALIBRATED):])])

    source = logging.getLogger("diffusers.hooks.mag_cache")
    handler, level = Ratios(), source.level
    source.addHandler(handler)
    source.setLevel(logging.INFO)
    try:
        with hooks_enabled(transformer, MagCacheConfig(calibrate=True,
                                                       num_inference_steps=steps)):
            run()
    finally:
        source.removeHandler(handler)
        source.setLevel(level)
    return found


_CALIBRATED = "MagCache Calibration Results: "


@contextmanager
def hooks_enabled(transformer: torch.nn.Module, config: Any | None) -> Iterator[None]:
    """``transformer`` with the hooks of ``config`` (None: none) for the block, as a user of
    the monolithic pipeline enables them."""
    if config is None:
        yield
        return
    model = cast(CacheMixin, transformer)
    model.enable_cache(config)
    try:
        yield
    finally:
        model.disable_cache()
