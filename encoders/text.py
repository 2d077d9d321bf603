"""Text conditions: tokenize, key by token ids, look up with single-flight, encode on a miss.

The key is built from the encoder's own token ids, attention mask and max length, never from
the raw string: texts the tokenizer merges (case, spacing) share an entry, texts it keeps apart
never do. Tokenizing costs microseconds; encoding costs milliseconds to seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image

from cachesvc.ledger import Ledger
from cachesvc.single_flight import Outcome
from cachesvc.tensor_cache import TensorCache
from encoders.image import stored_image
from keys import Fingerprint, GenerationSpec, StoreKey, embedding_key, image_embedding_key


class TokenizedText(Protocol):
    @property
    def ids(self) -> Sequence[int]: ...

    @property
    def mask(self) -> Sequence[int]: ...


class TextModel(Protocol):
    """What a model family provides for text conditioning."""

    fingerprint: Fingerprint
    max_length: int

    def tokenize(self, text: str) -> TokenizedText: ...

    def encode(self, tokens: TokenizedText) -> torch.Tensor: ...

    def text_positions(self, tokens: TokenizedText, embedding: torch.Tensor) -> int:
        """How many leading positions of ``embedding`` hold the text, not padding."""
        ...


@runtime_checkable
class ImageTextModel(Protocol):
    """What a family whose text encoder reads each text with the request's input image
    provides (an instruction-editing model's)."""

    fingerprint: Fingerprint  # the encoder's, its image processing and condition size too

    def tokenize(self, text: str) -> TokenizedText:
        """The text in its template, the image's place one placeholder."""
        ...

    def encode_with_image(self, text: str, image: Image.Image) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class EncodedText:
    text: str
    key: StoreKey
    tensor: torch.Tensor
    hit: bool  # found in the cache (possibly after waiting for another encoder)
    positions: int  # the leading positions of ``tensor`` that hold the text


class PromptView(Protocol):
    """How approximate reuse compares prompts: a request's condition embedding made into one
    unit vector, compared by inner product within the request's reuse bucket."""

    # Part of the reuse bucket: vectors of two views are never compared.
    name: str

    def vector(self, embedding: torch.Tensor, positions: int,
               spec: GenerationSpec) -> np.ndarray:
        """The unit vector of ``embedding`` (its first ``positions`` positions hold the text)
        for a request shaped as ``spec``."""
        ...


def unit(vector: torch.Tensor) -> np.ndarray:
    """``vector`` flattened, as float32 on the CPU, of length 1 (unless it is zero)."""
    out = vector.detach().to("cpu", torch.float64).flatten().numpy().astype(np.float32)
    norm = float(np.linalg.norm(out))
    return out / norm if norm > 0 else out


class MeanPooled:
    """The embedding averaged over its text positions: any model's view, with no weight but
    the text encoder's. It compares prompts by their words more than by what they ask for."""

    name = "text-mean"

    def vector(self, embedding: torch.Tensor, positions: int,
               spec: GenerationSpec) -> np.ndarray:
        rows = embedding.reshape(-1, embedding.shape[-1])[:max(1, positions)]
        return unit(rows.detach().to("cpu", torch.float64).mean(dim=0))


def prompt_vector(model: TextModel, view: PromptView, text: str,
                  spec: GenerationSpec) -> np.ndarray:
    """``view``'s vector of a text encoded here, without the cache (benchmarks)."""
    tokens = model.tokenize(text)
    embedding = model.encode(tokens)
    return view.vector(embedding, model.text_positions(tokens, embedding), spec)


def encode_texts(cache: TensorCache, model: TextModel, tenant: str,
                 texts: Sequence[str], ledger: Ledger | None = None) -> dict[str, EncodedText]:
    """Embeddings of each distinct text, from the cache where possible; each text's lookup
    counted in the job's ``ledger``."""
    out: dict[str, EncodedText] = {}
    for text in dict.fromkeys(texts):
        tokens = model.tokenize(text)
        key = embedding_key(tenant, model.fingerprint, tokens.ids, tokens.mask, model.max_length)
        cached = cache.get_or_compute(key, functools.partial(model.encode, tokens), ledger)
        hit = cached.outcome in (Outcome.HIT, Outcome.WAITED)
        out[text] = EncodedText(text, key, cached.tensor, hit,
                                model.text_positions(tokens, cached.tensor))
    return out


def encode_texts_with_image(cache: TensorCache, model: ImageTextModel, spec: GenerationSpec,
                            texts: Sequence[str], ledger: Ledger | None = None
                            ) -> dict[str, EncodedText]:
    """Embeddings of each distinct text read with ``spec``'s input image, from the cache where
    possible (the image is read from the store only on a miss); ImageLostError if it must be
    and is not there."""
    if spec.image is None:
        raise ValueError(f"request {spec.request_id}: the served model reads its texts with an "
                         "input image, and the request names none")
    out: dict[str, EncodedText] = {}
    for text in dict.fromkeys(texts):
        tokens = model.tokenize(text)
        key = image_embedding_key(spec.tenant, model.fingerprint, tokens.ids, spec.image)
        compute = functools.partial(stored_image, cache, spec, spec.image.hash, "RGB",
                                    functools.partial(model.encode_with_image, text))
        cached = cache.get_or_compute(key, compute, ledger)
        hit = cached.outcome in (Outcome.HIT, Outcome.WAITED)
        # Every position holds the text or the image it is read with: none is padding.
        out[text] = EncodedText(text, key, cached.tensor, hit, int(cached.tensor.shape[-2]))
    return out
