"""Counting a prompt's tokens for the request limit, with the tokenizer the workers published.

Admission runs where the model folder may not be (the API's head pod, a laptop running
``diffcache submit``), so the tokenizer comes from Redis and is parsed by the ``tokenizers``
library, which is no model code. Tokens are counted as the text encoder's tokenizer splits the
text, special tokens aside: the family's ``max_prompt_tokens`` already leaves room for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tokenizers import Tokenizer

from cachesvc.redis_client import RedisClient
from workers.queue.served_model import ServedModel, read_tokenizer

TokenCounter = Callable[[str], int]


class TokenCounters:
    """Token counters for the served model, its tokenizer parsed once per content hash (a
    real tokenizer is megabytes of JSON)."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._parsed: tuple[str, Tokenizer] | None = None  # the latest model's only

    def counter(self, model: ServedModel) -> TokenCounter:
        """NotPublishedError when the model's tokenizer is not in Redis."""
        tokenizer = self._tokenizer(model.tokenizer)
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)

    def _tokenizer(self, digest: str) -> Tokenizer:
        with self._lock:
            if self._parsed is None or self._parsed[0] != digest:
                self._parsed = (digest, Tokenizer.from_str(read_tokenizer(self._client,
                                                                          digest)))
            return self._parsed[1]
