"""LoRA adapters on a loaded denoiser, as each job asks for them.

Adapters come from the store by content hash (never from disk), are loaded once with diffusers'
PEFT integration and kept in a bounded LRU. peft applies none of them itself: each row of a
forward applies its own run's (``workers/engine/row_adapters.py``), so runs of different
adapter sets share the engine, and the base weights are never touched.
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
from workers.engine.forward_rows import RowAdapters

log = logging.getLogger(__name__)


class AdapterMissingError(RuntimeError):
    """An adapter a request names is not in the store: it was deleted, or lost with the store's
    memory. Adapters are uploaded, not computed, so only uploading it again helps."""


@dataclass
class AdapterStats:
    """Loads and swaps of one worker, for its record fields and logs."""

    loads: int = 0
    swaps: int = 0  # adapters unloaded to make room for another
    load_seconds: float = 0.0
    active: tuple[LoraUse, ...] = field(default_factory=tuple)


def adapter_name(content_hash: str) -> str:
    return f"lora_{content_hash}"


def row_adapters(loras: Sequence[LoraUse]) -> RowAdapters:
    """The adapters a run's rows apply, in its order: peft's name and the scale of each."""
    return tuple((adapter_name(lora.hash), float(lora.scale)) for lora in loras)


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

    def ensure(self, tenant: str, loras: Sequence[LoraUse], in_use: set[str]) -> None:
        """Load those of ``loras`` not loaded yet, evicting only adapters outside ``in_use``
        (the hashes the engine's runs apply), least recently used first."""
        for lora in loras:
            self._ensure_loaded(tenant, lora.hash, in_use | {u.hash for u in loras})
        self.stats.active = tuple(loras)
        if self._report is not None:
            self._report(self.stats, tuple(self._loaded))

    def _ensure_loaded(self, tenant: str, content_hash: str, keep: set[str]) -> None:
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
            evicted = next((h for h in self._loaded if h not in keep), None)
            if evicted is None:  # the scheduler keeps a forward's adapters within capacity
                raise RuntimeError(f"no LoRA slot free: {self.capacity} held, all in use")
            del self._loaded[evicted]
            self.transformer.delete_adapters([adapter_name(evicted)])  # type: ignore[attr-defined]
            self.stats.swaps += 1
        self.transformer.load_lora_adapter(  # type: ignore[attr-defined]
            state, adapter_name=adapter_name(content_hash), prefix="transformer")
        self._loaded[content_hash] = None
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start
        log.info("loaded LoRA adapter %s in %.2f s", content_hash,
                 time.perf_counter() - start)
