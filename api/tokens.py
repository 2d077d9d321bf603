"""Counting a prompt's tokens for the request limit, with the served model's own tokenizer.

The API imports no model code: the ``tokenizers`` library reads the model folder's
``tokenizer.json`` (both families' tokenizers save one). Where the folder is not on this
machine, a word-and-punctuation count stands in, which the word-level tokenizer equals.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

_PRETOKEN = re.compile(r"\w+|[^\w\s]+")

TokenCounter = Callable[[str], int]


def word_count(text: str) -> int:
    return len(_PRETOKEN.findall(text))


def token_counter(model_dir: Path) -> TokenCounter:
    """Tokens of a text as the served model's tokenizer splits it, special tokens aside."""
    path = model_dir / "tokenizer" / "tokenizer.json"
    if not path.exists():
        return word_count
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
