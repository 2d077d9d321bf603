"""LoRA adapters on a loaded denoiser, as each job asks for them.

Adapters come from the store by content hash (never from disk), are loaded once with diffusers'
PEFT integration and kept in a bounded LRU, and are set with the job's scales at the job's start,
never mid-step. The base weights are never reloaded: a job without adapters runs with them all
disabled, which is the base model exactly.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from safetensors.torch import load as load_safetensors

from cachesvc.tensor_cache import TensorCache
from keys import LoraUse, adapter_key

log = logging.getLogger(__name__)


class AdapterMissingError(RuntimeError):
    """An adapter a request names is not in the store: it was deleted, or lost with the store's
    memory. Adapters are uploaded, not computed, so only uploading it again helps."""


@dataclass
class AdapterStats:
    """Loads and swaps of one worker, for its record fields and logs."""

    loads: int = 0
    swaps: int = 0
    load_seconds: float = 0.0
    active: tuple[LoraUse, ...] = field(default_factory=tuple)


def adapter_name(content_hash: str) -> str:
    return f"lora_{content_hash}"


class LoadedAdapters:
    """The adapters loaded into one denoiser (``transformer``), least recently used first."""

    def __init__(self, cache: TensorCache, transformer: object, capacity: int,
                 report: Callable[[AdapterStats, tuple[str, ...]], None] | None = None) -> None:
        self.cache = cache
        self.transformer = transformer
        self.capacity = capacity
        self._report = report
        self.stats = AdapterStats()
        self._loaded: OrderedDict[str, None] = OrderedDict()

    def apply(self, tenant: str, loras: Sequence[LoraUse]) -> None:
        """Make the denoiser run with exactly ``loras`` at their scales."""
        wanted = tuple(loras)
        if wanted == self.stats.active:
            return
        model: object = self.transformer
        if not loras:
            if self._loaded:
                model.disable_lora()  # type: ignore[attr-defined]
            self.stats.active = ()
            return
        for lora in loras:
            self._ensure_loaded(tenant, lora.hash)
        model.enable_lora()  # type: ignore[attr-defined]
        model.set_adapters([adapter_name(lora.hash) for lora in loras],  # type: ignore[attr-defined]
                           [float(lora.scale) for lora in loras])
        self.stats.swaps += 1
        self.stats.active = wanted
        if self._report is not None:
            self._report(self.stats, tuple(self._loaded))

    def _ensure_loaded(self, tenant: str, content_hash: str) -> None:
        if content_hash in self._loaded:
            self._loaded.move_to_end(content_hash)
            return
        start = time.perf_counter()
        data = self.cache.get(adapter_key(tenant, content_hash))  # counted: adapter store hits
        if data is None:
            raise AdapterMissingError(f"LoRA adapter {content_hash} of tenant {tenant} is not in "
                                      "the store; upload it again (POST /v1/adapters)")
        state = load_safetensors(data.numpy().tobytes())  # safetensors: never unpickled
        while len(self._loaded) >= self.capacity:
            evicted, _ = self._loaded.popitem(last=False)
            self.transformer.delete_adapters([adapter_name(evicted)])  # type: ignore[attr-defined]
        self.transformer.load_lora_adapter(  # type: ignore[attr-defined]
            state, adapter_name=adapter_name(content_hash), prefix="transformer")
        self._loaded[content_hash] = None
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start
        log.info("loaded LoRA adapter %s in %.2f s", content_hash,
                 time.perf_counter() - start)
