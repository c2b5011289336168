"""Megatron indexed datasets (``.bin``/``.idx``) through ``megatron.core.datasets``.

``check_indexed_dataset(prefix)`` validates a pair before Megatron memory-maps it, so a
missing, truncated or corrupt file fails at start with the file name and the problem instead
of an assertion or a crash deep in a data loader. ``build_gpt_datasets`` wraps
``BlendedMegatronDatasetBuilder`` + ``GPTDataset``. Megatron caches its shuffle indices in
``data_cache_path`` or, by default, in ``<prefix dir>/cache/GPTDataset_indices``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
from typing import Optional

import numpy as np

from megatron_ext.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
# Megatron's DType codes -> item size in bytes.
_ITEM_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}


class DataFileError(DataError):
    """A missing, truncated or corrupt ``.bin`` / ``.idx`` file."""


def check_indexed_dataset(prefix: str) -> dict:
    """Validate ``prefix.idx`` / ``prefix.bin``; return {'sequences', 'documents', 'tokens'}."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataFileError(f"{path}: missing (data_path entries are prefixes of a "
                                ".bin/.idx pair written by tools/preprocess_data.py)")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES:
            raise DataFileError(f"{idx_path}: truncated ({idx_size} bytes, header needs {_HEADER_BYTES})")
        if head[:9] != _MAGIC:
            raise DataFileError(f"{idx_path}: not a Megatron index file (bad magic {head[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise DataFileError(f"{idx_path}: unsupported index version {version} (expected 1)")
        if code not in _ITEM_SIZE:
            raise DataFileError(f"{idx_path}: unknown token dtype code {code}")
        arrays = n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size not in (_HEADER_BYTES + arrays, _HEADER_BYTES + arrays + n_seq):
            raise DataFileError(f"{idx_path}: truncated or corrupt: {idx_size} bytes, but its header "
                                f"({n_seq} sequences, {n_doc} document bounds) implies "
                                f"{_HEADER_BYTES + arrays}")
        lengths = np.frombuffer(f.read(n_seq * 4), dtype=np.int32)
        f.seek(n_seq * 8, os.SEEK_CUR)  # sequence byte offsets follow from the lengths
        doc_bounds = np.frombuffer(f.read(n_doc * 8), dtype=np.int64)
    if n_doc < 1 or doc_bounds[0] != 0 or doc_bounds[-1] != n_seq or np.any(np.diff(doc_bounds) < 0):
        raise DataFileError(f"{idx_path}: corrupt document index (must rise from 0 to {n_seq})")
    if np.any(lengths < 0):
        raise DataFileError(f"{idx_path}: corrupt (negative sequence lengths)")
    tokens = int(lengths.sum(dtype=np.int64))
    expected_bin = tokens * _ITEM_SIZE[code]
    bin_size = os.path.getsize(bin_path)
    if bin_size != expected_bin:
        what = "truncated" if bin_size < expected_bin else "longer than its index"
        raise DataFileError(f"{bin_path}: {what}: {bin_size} bytes, {idx_path} describes "
                            f"{tokens} tokens = {expected_bin} bytes")
    return {"sequences": int(n_seq), "documents": int(n_doc - 1), "tokens": tokens}


def ensure_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.helpers_cpp`` importable.

    The megatron-core wheel ships it prebuilt; from a source install it must be compiled.
    We compile ``helpers.cpp`` with the system C++ compiler into a per-user cache
    (``$XDG_CACHE_HOME/megatron_ext/helpers``) and load it from there, so nothing in the
    installed package has to be writable.
    """
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError:
        pass
    import subprocess
    import sys
    import sysconfig

    import megatron.core.datasets as mcd

    src = os.path.join(os.path.dirname(mcd.__file__), "helpers.cpp")
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "megatron_ext", "helpers")
    out = os.path.join(cache, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(out):
        try:
            import pybind11
        except ImportError:
            raise RuntimeError("megatron.core.datasets.helpers_cpp is missing and compiling it "
                               "needs pybind11: pip install pybind11") from None
        os.makedirs(cache, exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        cmd = [os.environ.get("CXX", "c++"), "-O3", "-shared", "-std=c++17", "-fPIC", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", src, "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, out)
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["megatron.core.datasets.helpers_cpp"] = module


def build_gpt_datasets(data_path: list[str], split: str, tokenizer, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], data_cache_path: Optional[str] = None,
                       eod_mask_loss: bool = False) -> list:
    """[train, valid, test] Megatron ``GPTDataset``s (or blends) with ``num_samples`` each."""
    from megatron.core.datasets.utils import get_blend_from_list

    blend = get_blend_from_list(list(data_path))
    for prefix in blend[0]:
        check_indexed_dataset(prefix)
    ensure_dataset_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
        path_to_cache=data_cache_path, tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=eod_mask_loss, create_attention_mask=False,
    )
    sizes = [n if n > 0 else None for n in num_samples]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
