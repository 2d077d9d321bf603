"""How long each kind of entry lives and how it competes for memory.

Embeddings are soft-pinned: the hot ones (the negative prompt above all) survive eviction, and
Mooncake's LRU evicts unpinned entries first. Checkpoints, CFG features and outputs expire after
a TTL. Final latents have a single consumer and are deleted when it reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from config.settings import CacheSettings
from keys import KeyKind


@dataclass(frozen=True, slots=True)
class KindPolicy:
    soft_pin: bool
    ttl_s: float | None
    delete_on_consume: bool

    def expiry_ms(self, now_ms: int) -> int:
        """The expiry an entry written at ``now_ms`` carries in its header and TTL index; 0
        for kinds that never expire."""
        return 0 if self.ttl_s is None else now_ms + int(self.ttl_s * 1000)


def policies(settings: CacheSettings) -> Mapping[KeyKind, KindPolicy]:
    return {
        KeyKind.EMBEDDING: KindPolicy(soft_pin=True, ttl_s=None, delete_on_consume=False),
        KeyKind.CFG: KindPolicy(soft_pin=False, ttl_s=settings.cfg_ttl_s,
                                delete_on_consume=False),
        KeyKind.CHECKPOINT: KindPolicy(soft_pin=False, ttl_s=settings.checkpoint_ttl_s,
                                       delete_on_consume=False),
        KeyKind.LATENTS: KindPolicy(soft_pin=False, ttl_s=settings.latents_ttl_s,
                                    delete_on_consume=True),
        KeyKind.OUTPUT: KindPolicy(soft_pin=False, ttl_s=settings.output_ttl_s,
                                   delete_on_consume=False),
        # Uploaded, not computed: pinned, never expired (``DELETE /v1/adapters`` removes one).
        KeyKind.ADAPTER: KindPolicy(soft_pin=True, ttl_s=None, delete_on_consume=False),
        # Uploaded too, and kept on disk: pinned, never expired.
        KeyKind.IMAGE: KindPolicy(soft_pin=True, ttl_s=None, delete_on_consume=False),
        # Computed from an uploaded image, shared by every request that edits it at a size:
        # pinned like a text's embedding.
        KeyKind.IMAGE_LATENT: KindPolicy(soft_pin=True, ttl_s=None, delete_on_consume=False),
        # An instruction read with its image: pinned like a text's embedding.
        KeyKind.IMAGE_EMBEDDING: KindPolicy(soft_pin=True, ttl_s=None,
                                            delete_on_consume=False),
        # Small, and shared by every request that repaints through that mask at a size.
        KeyKind.IMAGE_MASK: KindPolicy(soft_pin=True, ttl_s=None, delete_on_consume=False),
        KeyKind.SCRATCH: KindPolicy(soft_pin=False, ttl_s=None, delete_on_consume=False),
    }
