"""A request's step-cache policy as the diffusers hook configuration that runs it: the denoiser
and the monolithic reference enable the same one, so their outputs compare bit for bit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from diffusers.models.cache_utils import CacheMixin

from keys import StepCache, StepCachePolicy


def hook_config(cache: StepCache, attention: Sequence[str] | None = None) -> Any:
    """The ``enable_cache`` configuration of ``cache``. ``attention``: the patterns of the
    attention modules TaylorSeer forecasts, where diffusers' defaults match none of the
    family's (they must end in ``attn``)."""
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if cache.policy is StepCachePolicy.FIRST_BLOCK:
        return FirstBlockCacheConfig(threshold=float(cache.param("threshold")))
    if cache.policy is StepCachePolicy.TAYLORSEER:
        return TaylorSeerCacheConfig(cache_interval=int(cache.param("interval")),
                                     disable_cache_before_step=int(cache.param("warmup")),
                                     max_order=int(cache.param("max_order")),
                                     cache_identifiers=None if attention is None
                                     else list(attention))
    raise ValueError(f"step_cache.policy {cache.policy.value} has no hook here")


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
