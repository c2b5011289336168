"""Checksums of a checkpoint's files, written with the checkpoint and verified before it is loaded.

torch's distributed checkpoint format (dist_checkpointing's ``torch_dist``) keeps no integrity data
of its own: a shard overwritten in place still loads. ``write_manifest`` records the size of every
file of a finished save and the CRC-32 of each BLOCK_BYTES block of it in ``checksums.json`` (inside
the checkpoint directory, so it is renamed into place with it); ``damaged_files`` re-reads them and
lists what no longer matches. The blocks, not the files, are the unit of work: they are split over
the ranks (every rank takes ``blocks[rank::world]``) and each rank checksums its share on a few
threads (zlib releases the GIL), so one rank's 47 GB shard is not one core's work (~2-3 GB/s each).
The cost is one read of the checkpoint spread over the job: right after a save the files are still in
the page cache. CRC-32 catches accidental damage (bit rot, truncation, a partial copy), not
deliberate tampering. Manifests written before the blocks (one ``crc32`` per file) still verify.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch.distributed as dist

MANIFEST_FILE = "checksums.json"
BLOCK_BYTES = 64 << 20  # one unit of work; a file has ceil(size / BLOCK_BYTES) checksums (at least one)
_READ_BYTES = 4 << 20  # one thread's buffer, read into again and again: no allocation per read
_MAX_THREADS = 8


def _crc32_range(path: str, offset: int, length: int) -> str:
    """CRC-32 of ``length`` bytes of ``path`` from ``offset`` (of what is there: a shorter file ends it)."""
    crc, done = 0, 0
    view = memoryview(bytearray(max(1, min(_READ_BYTES, length))))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < length:
            n = f.readinto(view[:min(len(view), length - done)])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            done += n
    return f"{crc:08x}"


def _threads() -> int:
    """Threads per rank: this process's cores shared by the ranks of this node, at most _MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(_MAX_THREADS, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def _checksums(ranges: list[tuple[str, int, int]]) -> list[str]:
    """``_crc32_range`` of each ``(path, offset, length)``, on a few threads, in order."""
    if len(ranges) < 2:
        return [_crc32_range(*r) for r in ranges]
    with ThreadPoolExecutor(min(_threads(), len(ranges))) as pool:
        return list(pool.map(lambda r: _crc32_range(*r), ranges))


def _blocks(size: int, block_bytes: Optional[int]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each block of a file of ``size`` bytes; one block when ``block_bytes`` is None."""
    if not block_bytes or size <= block_bytes:
        return [(0, size)]
    return [(start, min(block_bytes, size - start)) for start in range(0, size, block_bytes)]


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


def write_manifest(checkpoint_dir: str, block_bytes: int = BLOCK_BYTES) -> None:
    """Every rank: checksum a share of the blocks of ``checkpoint_dir``'s files; rank 0 writes ``checksums.json``.
    Call after every rank finished writing (a barrier) and before the directory is published."""
    rank, world = _rank_and_world()
    names = sorted(n for n in os.listdir(checkpoint_dir)
                   if n != MANIFEST_FILE and os.path.isfile(os.path.join(checkpoint_dir, n)))
    sizes = {n: os.path.getsize(os.path.join(checkpoint_dir, n)) for n in names}
    units = [(n, offset, length) for n in names for offset, length in _blocks(sizes[n], block_bytes)]
    mine = units[rank::world]
    crcs = _checksums([(os.path.join(checkpoint_dir, n), offset, length) for n, offset, length in mine])
    found = dict(_gathered([((n, offset), crc) for (n, offset, _), crc in zip(mine, crcs)]))
    if rank == 0:
        files = {n: {"size": sizes[n], "crc32": []} for n in names}
        for n, offset, _ in units:  # each file's blocks in order
            files[n]["crc32"].append(found[n, offset])
        with open(os.path.join(checkpoint_dir, MANIFEST_FILE), "w") as f:
            json.dump({"algorithm": "crc32", "block_bytes": block_bytes, "files": files}, f, indent=1)


def read_manifest(checkpoint_dir: str) -> Optional[dict]:
    """``{"block_bytes": B or None, "files": {name: {"size", "crc32": [one per block]}}}`` (a manifest of one
    checksum per file reads as one block per file), None for a checkpoint saved without one, or
    ``{"unreadable": True}``."""
    path = os.path.join(checkpoint_dir, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = {name: {"size": int(entry["size"]),
                        "crc32": [entry["crc32"]] if isinstance(entry["crc32"], str) else list(entry["crc32"])}
                 for name, entry in manifest["files"].items()}
        return {"block_bytes": manifest.get("block_bytes"), "files": files}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"unreadable": True}


def damaged_files(checkpoint_dir: str) -> Optional[list[str]]:
    """Every rank: ``["<file>: <what is wrong>", ...]`` (empty when intact; the same list on every
    rank), or None when the checkpoint has no manifest to check against."""
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        return None
    rank, world = _rank_and_world()
    problems, units = [], []  # sizes: every rank sees the same; rank 0 reports them
    if manifest.get("unreadable"):  # still through the gather below: every rank takes part in it
        problems.append(f"{os.path.join(checkpoint_dir, MANIFEST_FILE)}: unreadable or not a checksum manifest")
    for name, expected in sorted(manifest.get("files", {}).items()):
        path = os.path.join(checkpoint_dir, name)
        blocks = _blocks(expected["size"], manifest["block_bytes"])
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != expected["size"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, {expected['size']} when saved")
        elif len(blocks) != len(expected["crc32"]):
            problems.append(f"{path}: its checksums do not cover its {expected['size']} bytes")
        else:
            units += [(path, offset, length, crc) for (offset, length), crc in zip(blocks, expected["crc32"])]
    mine = units[rank::world]
    crcs = _checksums([(path, offset, length) for path, offset, length, _ in mine])
    changed = {path for (path, _, _, expected), crc in zip(mine, crcs) if crc != expected}
    mine_problems = (problems if rank == 0 else []) + [
        f"{path}: contents changed since the save (CRC-32 mismatch)" for path in sorted(changed)]
    return sorted(set(_gathered(mine_problems)))
