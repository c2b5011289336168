"""checksums.json (megatron_ext/training/checkpoint_integrity.py): a CRC-32 per block of every file, computed on
threads and split over the ranks, equal to zlib's over the same bytes; damage anywhere named once; manifests of
one checksum per file (saved before the blocks) still verify."""

import json
import os
import random
import zlib

import pytest

from megatron_ext.training import checkpoint_integrity as integrity
from tests._dist import run_distributed

BLOCK = 1000
SIZES = {"empty": 0, "under": 999, "exact": 1000, "over": 1001, "many": 3500}


def _checkpoint(directory, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    files = {name: rng.randbytes(size) for name, size in SIZES.items()}
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return files


def _reference_blocks(data: bytes) -> list[str]:
    starts = range(0, len(data), BLOCK) if len(data) > BLOCK else [0]
    return [f"{zlib.crc32(data[s:s + BLOCK]):08x}" for s in starts]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("threads", [1, 4])
def test_each_block_checksum_is_zlibs_over_its_bytes(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(integrity, "_MAX_THREADS", threads)
    files = _checkpoint(tmp_path)
    integrity.write_manifest(str(tmp_path), block_bytes=BLOCK)
    manifest = json.loads((tmp_path / integrity.MANIFEST_FILE).read_text())
    assert manifest["block_bytes"] == BLOCK
    assert manifest["files"] == {name: {"size": len(data), "crc32": _reference_blocks(data)}
                                 for name, data in files.items()}
    assert [len(manifest["files"][n]["crc32"]) for n in SIZES] == [1, 1, 1, 2, 4]
    assert integrity.damaged_files(str(tmp_path)) == []


def test_damage_in_any_block_is_named_once(tmp_path):
    _checkpoint(tmp_path)
    integrity.write_manifest(str(tmp_path), block_bytes=BLOCK)
    _flip(tmp_path / "many", 2 * BLOCK + 17)  # the third block
    _flip(tmp_path / "many", 3 * BLOCK + 1)  # and the last, short one
    _flip(tmp_path / "over", BLOCK)  # the one byte of the second block
    with open(tmp_path / "under", "ab") as f:
        f.write(b"x")
    os.remove(tmp_path / "exact")
    assert integrity.damaged_files(str(tmp_path)) == [
        f"{tmp_path}/exact: missing",
        f"{tmp_path}/many: contents changed since the save (CRC-32 mismatch)",
        f"{tmp_path}/over: contents changed since the save (CRC-32 mismatch)",
        f"{tmp_path}/under: 1000 bytes, 999 when saved",
    ]


def test_a_manifest_of_one_checksum_per_file_still_verifies(tmp_path):
    files = _checkpoint(tmp_path)
    old = {"algorithm": "crc32", "files": {n: {"size": len(d), "crc32": f"{zlib.crc32(d):08x}"} for n, d in files.items()}}
    (tmp_path / integrity.MANIFEST_FILE).write_text(json.dumps(old))
    assert integrity.damaged_files(str(tmp_path)) == []
    _flip(tmp_path / "many", 3000)
    assert integrity.damaged_files(str(tmp_path)) == [
        f"{tmp_path}/many: contents changed since the save (CRC-32 mismatch)"]


def test_an_unreadable_manifest_is_itself_reported(tmp_path):
    _checkpoint(tmp_path)
    assert integrity.damaged_files(str(tmp_path)) is None  # no manifest: nothing to check against
    (tmp_path / integrity.MANIFEST_FILE).write_text('{"files": {"many": {"size": 3500}}}')
    assert integrity.damaged_files(str(tmp_path)) == [
        f"{tmp_path}/{integrity.MANIFEST_FILE}: unreadable or not a checksum manifest"]


def _two_rank_worker(rank, world, directory):
    import torch.distributed as dist

    integrity.write_manifest(directory, block_bytes=BLOCK)
    dist.barrier()  # as the save does: rank 0 writes the manifest after the gather
    intact = integrity.damaged_files(directory)
    dist.barrier()
    if rank == 1:
        _flip(os.path.join(directory, "many"), 10)  # a block rank 0 checks: every rank must still say so
    dist.barrier()
    return intact, integrity.damaged_files(directory)


def test_two_ranks_split_the_blocks_and_agree(tmp_path):
    files = _checkpoint(tmp_path / "ckpt")
    results = run_distributed(_two_rank_worker, 2, str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / integrity.MANIFEST_FILE).read_text())
    assert manifest["files"] == {n: {"size": len(d), "crc32": _reference_blocks(d)} for n, d in files.items()}
    for intact, damaged in results:
        assert intact == [] and damaged == [f"{tmp_path}/ckpt/many: contents changed since the save (CRC-32 mismatch)"]
