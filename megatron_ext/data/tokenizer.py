"""Tokenizers: a byte-level one (the default, nothing to download) and a local HF tokenizer.json.

Both expose what Megatron-Core's GPT datasets read from a tokenizer: ``vocab_size``, ``eod``
(and no ``pad``, so padding uses Megatron's -1 sentinel), plus ``tokenize`` / ``detokenize``.
``vocab_size`` is the true vocabulary; padding it to a multiple of the TP size is the model's job.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from megatron_ext.errors import DataError


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; id 256 is EOD. ``vocab_size`` = 257."""

    vocab_size = 257
    eod = 256
    # Megatron's dataset cache key includes the tokenizer's identity.
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 257}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def tokenize_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# Tried in order when the caller does not name the end-of-document token.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class JsonFileTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded from a local file with the ``tokenizers`` package."""

    def __init__(self, path: str, eod_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                f"--tokenizer-json {path} needs the 'tokenizers' package: "
                "pip install tokenizers (or pip install kimi-megatron[tokenizers])"
            ) from None
        if not os.path.isfile(path):
            raise DataError(f"tokenizer_json: tokenizer file {path} does not exist")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:
            raise DataError(f"tokenizer_json: {path} is not a valid tokenizer.json: {exc}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else _EOD_CANDIDATES
        for name in candidates:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                self.eod = token_id
                break
        else:
            raise DataError(f"tokenizer_json: {path} has no end-of-document token; "
                             f"looked for {', '.join(candidates)}")
        self.unique_identifiers = {"class": "JsonFileTokenizer", "path": os.path.abspath(path),
                                   "vocab_size": self.vocab_size, "eod": self.eod}

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(tokenizer_json: Optional[str] = None, eod_token: Optional[str] = None):
    """The byte tokenizer, or the local tokenizer.json at ``tokenizer_json``."""
    return ByteTokenizer() if tokenizer_json is None else JsonFileTokenizer(tokenizer_json, eod_token)
