"""The default offline corpus: the running Python's standard-library ``.py`` sources.

Files are found under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and
``__pycache__`` excluded), read in sorted relative-path order, tokenized, each followed by
EOD. A file goes to train / valid / test by a stable hash (CRC-32) of its relative path, so
the split does not depend on which other files exist or on ``stdlib_max_mb``. Nothing is
cached to disk: reading the full ~30 MB takes well under a second with the byte tokenizer.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from typing import Optional

import numpy as np

from megatron_ext.data.tokenizer import ByteTokenizer

SPLIT_NAMES = ("train", "valid", "test")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_sources(root: Optional[str] = None) -> list[str]:
    """Relative paths (posix separators) of every ``.py`` file under ``root``, sorted."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)


def split_of(rel_path: str, weights: tuple[float, float, float]) -> str:
    """'train', 'valid' or 'test' for a file, from a stable hash of its relative path."""
    u = zlib.crc32(rel_path.encode("utf-8")) / 2**32
    if u < weights[0]:
        return "train"
    return "valid" if u < weights[0] + weights[1] else "test"


def load_stdlib_tokens(
    tokenizer,
    weights: tuple[float, float, float],
    max_mb: Optional[float] = None,
    root: Optional[str] = None,
) -> dict[str, np.ndarray]:
    """Token streams per split (1-D arrays, each document followed by ``tokenizer.eod``).

    ``max_mb`` caps the source read: split ``i`` takes files (in path order) until it holds
    ``max_mb * weights[i]`` MB, so even a small budget gives every split its share.
    """
    root = root or stdlib_root()
    budget = {name: (None if max_mb is None else max_mb * 1e6 * w) for name, w in zip(SPLIT_NAMES, weights)}
    read = dict.fromkeys(SPLIT_NAMES, 0)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_NAMES}
    eod = np.array([tokenizer.eod], dtype=np.int64)
    for rel in list_stdlib_sources(root):
        split = split_of(rel, weights)
        if budget[split] is not None and read[split] >= budget[split]:
            if all(b is not None and read[n] >= b for n, b in budget.items()):
                break
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        read[split] += len(data)
        if isinstance(tokenizer, ByteTokenizer):
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        else:
            ids = np.asarray(tokenizer.tokenize(data.decode("utf-8", errors="replace")), dtype=np.int64)
        parts[split].extend((ids, eod))
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    return {
        name: (np.concatenate(chunks) if chunks else np.zeros(0, np.int64)).astype(dtype)
        for name, chunks in parts.items()
    }
