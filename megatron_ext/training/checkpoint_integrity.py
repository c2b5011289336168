"""Checksums of a checkpoint's files, written with the checkpoint and verified before it is loaded.

torch's distributed checkpoint format (dist_checkpointing's ``torch_dist``) keeps no integrity data
of its own: a shard overwritten in place still loads. ``write_manifest`` records the size and
CRC-32 of every file of a finished save in ``checksums.json`` (inside the checkpoint directory,
so it is renamed into place with it); ``damaged_files`` re-reads them and lists what no longer
matches. Both split the files over the ranks (every rank reads ``files[rank::world]``), so the
cost is one read of the checkpoint spread over the job: right after a save the files are still in
the page cache. CRC-32 catches accidental damage (bit rot, truncation, a partial copy), not
deliberate tampering; zlib computes it at ~2 GB/s per core.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import torch.distributed as dist

MANIFEST_FILE = "checksums.json"
_CHUNK = 16 << 20


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(mine: list) -> list:
    """Every rank's list, concatenated in rank order (the same on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(mine)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return [item for part in parts for item in part]


def write_manifest(checkpoint_dir: str) -> None:
    """Every rank: checksum a share of ``checkpoint_dir``'s files; rank 0 writes ``checksums.json``.
    Call after every rank finished writing (a barrier) and before the directory is published."""
    rank, world = _rank_and_world()
    names = sorted(n for n in os.listdir(checkpoint_dir)
                   if n != MANIFEST_FILE and os.path.isfile(os.path.join(checkpoint_dir, n)))
    mine = [(n, os.path.getsize(os.path.join(checkpoint_dir, n)), file_crc32(os.path.join(checkpoint_dir, n)))
            for n in names[rank::world]]
    entries = _gathered(mine)
    if rank == 0:
        files = {name: {"size": size, "crc32": crc} for name, size, crc in sorted(entries)}
        with open(os.path.join(checkpoint_dir, MANIFEST_FILE), "w") as f:
            json.dump({"algorithm": "crc32", "files": files}, f, indent=1)


def read_manifest(checkpoint_dir: str) -> Optional[dict]:
    """``{file name: {"size", "crc32"}}``, or None for a checkpoint saved without one."""
    path = os.path.join(checkpoint_dir, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {MANIFEST_FILE: {"size": -1, "crc32": "unreadable"}}  # reported as damaged itself


def damaged_files(checkpoint_dir: str) -> Optional[list[str]]:
    """Every rank: ``["<file>: <what is wrong>", ...]`` (empty when intact; the same list on every
    rank), or None when the checkpoint has no manifest to check against."""
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        return None
    rank, world = _rank_and_world()
    mine = []
    for name in sorted(manifest)[rank::world]:
        expected = manifest[name]
        path = os.path.join(checkpoint_dir, name)
        if name == MANIFEST_FILE:
            mine.append(f"{path}: unreadable or not a checksum manifest")
        elif not os.path.isfile(path):
            mine.append(f"{path}: missing")
        elif os.path.getsize(path) != expected["size"]:
            mine.append(f"{path}: {os.path.getsize(path)} bytes, {expected['size']} when saved")
        elif file_crc32(path) != expected["crc32"]:
            mine.append(f"{path}: contents changed since the save (CRC-32 mismatch)")
    return sorted(_gathered(mine))
